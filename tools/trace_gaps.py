"""Where the GPU waits in a chrome trace of `tools/profile_torch.py --trace` (torch.profiler) or of
`tools/profile_jax.py` (jax.profiler's perfetto trace): the device's busy time against its span, the idle gaps
between consecutive kernels and copies summed by the pair of neighbours around them, and the device time per
kernel name per step.

Usage: python tools/trace_gaps.py [--steps S] TRACE.json[.gz] ...   (S: the fwd+bwd steps in a trace, 5 by
default, as profile_torch.py records). A development tool; runs on any machine.
"""
import collections
import gzip
import json
import sys

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
MIN_GAP_US = 5  # shorter gaps are a launch's own latency
NAME = 40       # characters of a kernel's name kept


def device_events(path):
    """The trace's kernels and copies by start time: torch.profiler's by category; in a JAX trace (no such
    categories) the events of the GPU processes' stream threads (their other threads, XLA's module and op
    lines, span the same kernels again)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    found = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENTS]
    if not found:
        names = {(e["pid"], e.get("tid"), e["name"]): e.get("args", {}).get("name", "")
                 for e in events if e.get("ph") == "M"}
        gpus = {pid for (pid, _, kind), name in names.items() if kind == "process_name" and "/device:GPU" in name}
        streams = {(pid, tid) for (pid, tid, kind), name in names.items()
                   if kind == "thread_name" and pid in gpus and name.startswith("Stream")}
        found = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]
    return sorted(found, key=lambda e: e["ts"])


def report(path, steps):
    events = device_events(path)
    if not events:
        return f"{path}: no device events"
    busy = sum(e["dur"] for e in events)
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    gaps = collections.Counter()
    for a, b in zip(events, events[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > MIN_GAP_US:
            gaps[(a["name"][:NAME], b["name"][:NAME])] += gap
    kernels = collections.Counter()
    for e in events:
        kernels[e["name"][:NAME]] += e["dur"]
    lines = [f"{path}: {len(events)} device events, busy {busy / 1e3 / steps:.2f} ms per step of a "
             f"{span / 1e3 / steps:.2f} ms span, idle {sum(gaps.values()) / 1e3 / steps:.2f} ms in gaps over "
             f"{MIN_GAP_US} us",
             "  idle ms per step, between:"]
    lines += [f"    {g / 1e3 / steps:7.3f}  {a} -> {b}" for (a, b), g in gaps.most_common(8)]
    lines.append("  device ms per step:")
    lines += [f"    {t / 1e3 / steps:7.3f}  {name}" for name, t in kernels.most_common(8)]
    return "\n".join(lines)


def main():
    args = sys.argv[1:]
    steps = 5
    if "--steps" in args:
        i = args.index("--steps")
        steps = int(args[i + 1])
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    for path in args:
        print(report(path, steps))


if __name__ == "__main__":
    main()
