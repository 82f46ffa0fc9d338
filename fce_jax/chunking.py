"""How the rows are cut into chunks, and where dZ lives. Twin: fce_torch/chunking.py."""

LOGITS_BUDGET_BYTES = 1 << 30  # the float32 logits of one chunk
STORED_LOGITS_BUDGET_BYTES = 1 << 29  # the same when every chunk's dZ is kept (it shares the memory with them)
ROW_MULTIPLE = 128


def chunk_rows(n_rows: int, vocab: int, requested: int | None = None, budget: int = LOGITS_BUDGET_BYTES) -> int:
    """Rows per chunk: `requested` if given, else the largest multiple of 128 whose float32 logits fit in
    `budget` bytes (at least 128); never more than `n_rows` (and at least 1)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {requested}")
        rows = requested
    else:
        rows = max(ROW_MULTIPLE, budget // (4 * max(vocab, 1)) // ROW_MULTIPLE * ROW_MULTIPLE)
    return max(1, min(n_rows, rows))


def plan(n_rows: int, hidden: int, vocab: int, itemsize: int, need_dw: bool,
         requested: int | None = None) -> tuple[int, bool]:
    """(rows per chunk, store): `store` keeps every chunk's dZ ([N, V] in the input dtype) for one dX and one
    dW GEMM after the last chunk, instead of a float32 [V, H] dW accumulator that every chunk reads and
    writes. It is chosen when there are several chunks and the kept dZ is no larger than that accumulator."""
    rows = chunk_rows(n_rows, vocab, requested)
    store = need_dw and rows < n_rows and n_rows * itemsize <= 4 * hidden
    if store and requested is None:
        rows = chunk_rows(n_rows, vocab, budget=STORED_LOGITS_BUDGET_BYTES)
    return rows, store
