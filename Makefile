# The two commands of the README's quick start. Each creates .venv (once) with what it needs.
PYTHON ?= python3
CONSTRAINTS ?= requirements/cpu.txt
EXTRAS ?= jax,torch,liger,test,bench
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: parity test bench-smoke venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	touch $(STAMP)

# The main job: the cross-framework parity-and-speed report on this machine's default device.
parity: $(STAMP)
	$(VENV)/bin/python -m parity $(ARGS)

# The tests (CPU: kernels in the Triton interpreter and Pallas interpret mode), in TEST_WORKERS processes
# (pytest-xdist), each test file in one of them: its module fixtures (the peers' driver, the bench smoke runs,
# the distributed jobs) start once. The files go out in tests/conftest.py's order, the longest first.
# TEST_WORKERS=0 runs them in this process. The slowest tests are listed last, to keep CI's time in view.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

bench-smoke: $(STAMP)
	$(VENV)/bin/python -m bench op --smoke

clean:
	rm -rf $(VENV) *.egg-info
