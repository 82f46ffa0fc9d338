"""The peers' own tests (Liger-Kernel 0.8.5, Cut Cross-Entropy 25.1.1 and main) run against fce's drop-ins.

``python -m tests.peers --help``; README.md beside this file says what runs, what is changed and why.
"""
