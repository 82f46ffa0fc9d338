"""The stages of one FLCE forward+backward, for `python -m parity --explain`. Twin: fce_jax/debug.py."""
from fce_core.options import FlceOptions

from .api import normalizer_tensor
from .checks import ValueCheck
from .flce import flce_sweep
from .kernels.grad_scale import as_grad


def debug_intermediates(x, w, y, bias=None, class_weights=None, normalizer=None, **options):
    """float32 logits and dlogits of the first chunk, lse of all rows, and the final dx, dw (db) of x [N, H].
    Checks the values as `fused_lce`'s validation does (`ValueCheck`), so that the same chunks run."""
    opt = FlceOptions(**options)
    normalizer = normalizer_tensor(normalizer, x.device) if opt.reduction == "mean" else None
    trace = {}
    check = ValueCheck(y, w.shape[0], opt.ignore_index, class_weights)
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                                  normalizer=normalizer, check=check, trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = as_grad(db, bias.dtype)
    return trace
