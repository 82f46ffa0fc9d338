"""The collectives of a compiled XLA program's text (``jax.jit(f).lower(...).compile().as_text()``)."""
import math
import re

_OPS = "all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute|collective-broadcast"
# "%name = <shape or tuple> op(" or "op-start(" at any nesting; the "-done" lines repeat the start and are skipped.
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>" + _OPS + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def collectives(text):
    """[(op, [result shape, ...])] of every collective in the program."""
    found = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(m.group("shape"))]
            found.append((m.group("op"), shapes))
    return found


def large_collectives(text, min_elements):
    """The collectives with a result of at least `min_elements` elements."""
    return [c for c in collectives(text) if any(math.prod(s) >= min_elements for s in c[1])]
