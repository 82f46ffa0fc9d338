"""What ptxas reports for sm_90a PTX, with the ptxas that the triton wheel ships: registers and spilled bytes per
thread. Used by tests/test_sm90_registers.py (fce_torch's kernels must not spill) and tools/gluon_dw.py."""
import os
import re
import subprocess

import triton


def ptxas_usage(ptx):
    """(registers, spill store bytes, spill load bytes) per thread that `ptxas -v` reports for `ptx` (sm_90a)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    result = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", "-", "-o", os.devnull], input=ptx,
                            capture_output=True, text=True, check=False)
    if result.returncode:  # an older ptxas reads no stdin: a file then
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fce_sm90_{os.getpid()}.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", path, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
        os.remove(path)
    out = result.stderr
    return (int(re.search(r"Used (\d+) registers", out).group(1)),
            int(re.search(r"(\d+) bytes spill stores", out).group(1)),
            int(re.search(r"(\d+) bytes spill loads", out).group(1)))
