"""How the rows are cut into chunks, and where dZ lives. Twin: fce_torch/chunking.py."""

LOGITS_BUDGET_BYTES = 1 << 30  # the float32 logits of one chunk
STORED_LOGITS_BUDGET_BYTES = 1 << 29  # the same when every chunk's dZ is kept (it shares the memory with them)
GROUPED_LOGITS_BUDGET_BYTES = 1 << 28  # the same next to the kept dZ of a group (a float32 dW accumulator too)
ROW_MULTIPLE = 128
KEPT_PROGRAMS = 8


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


def layout(n_rows: int, rows: int) -> tuple[int, int]:
    """(rows of the first chunk, number of chunks) for chunks of `rows` rows. The first chunk takes the
    remainder (1 to `rows` rows, 0 when there are none), so the chunks after it are full: once the valid rows
    come first, those past the last valid row are skipped whole without changing any chunk's shape."""
    n_chunks = max(1, -(-n_rows // rows))
    return n_rows - (n_chunks - 1) * rows, n_chunks


def kept_granule(n_chunks: int) -> int:
    """With store, the number of chunks that run is rounded up to a multiple of this: fce_jax compiles one
    program per possible number (its buffer shapes are static), at most KEPT_PROGRAMS of them."""
    return -(-n_chunks // KEPT_PROGRAMS)


def chunks_to_run(n_valid: int, first: int, rows: int, n_chunks: int, granule: int = 1) -> int:
    """The chunks that hold any of the `n_valid` valid rows once those come first (the first chunk always
    runs), rounded up to a multiple of `granule`, at most n_chunks."""
    needed = 1 + min(n_chunks - 1, max(0, -((first - n_valid) // rows)))
    return min(n_chunks, -(-needed // granule) * granule)
