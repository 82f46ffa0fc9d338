"""Cross-framework parity: DLPack bridge, float64 reference, case generator and the parity suite (python -m parity)."""
