"""``python -m tests.peers``: see driver.py and README.md."""
from .driver import main

raise SystemExit(main())
