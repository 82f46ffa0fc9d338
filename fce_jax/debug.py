"""The stages of one FLCE forward+backward, for `python -m parity --explain`. Twin: fce_torch/debug.py."""
from fce_core.options import FlceOptions

from .api import normalizer_array
from .flce import flce_sweep
from .kernels.grad_scale import as_grad


def debug_intermediates(x, w, y, bias=None, class_weights=None, normalizer=None, **options):
    """float32 logits and dlogits of the first chunk, lse of all rows, and the final dx, dw (db) of x [N, H].
    Runs eagerly (not under jit)."""
    opt = FlceOptions(**options)
    normalizer = normalizer_array(normalizer) if opt.reduction == "mean" else None
    trace = {}
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                                  normalizer=normalizer, trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = as_grad(db, bias.dtype)
    return trace
