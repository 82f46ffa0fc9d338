"""How many rows one chunk holds. Twin: fce_torch/chunking.py."""

LOGITS_BUDGET_BYTES = 1 << 30  # the float32 logits of one chunk
ROW_MULTIPLE = 128


def chunk_rows(n_rows: int, vocab: int, requested: int | None = None) -> int:
    """Rows per chunk: `requested` if given, else the largest multiple of 128 whose float32 logits fit in
    1 GiB (at least 128); never more than `n_rows` (and at least 1)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {requested}")
        rows = requested
    else:
        rows = max(ROW_MULTIPLE, LOGITS_BUDGET_BYTES // (4 * max(vocab, 1)) // ROW_MULTIPLE * ROW_MULTIPLE)
    return max(1, min(n_rows, rows))
