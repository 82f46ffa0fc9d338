"""A summary of Nsight Compute's per-instruction page (`ncu -i REPORT --page source --csv --print-source sass`)
for each kernel in it: the instructions executed by opcode (warp-level, and their share), the stall samples by
opcode and by reason, and the instructions with the most samples. Where two kernels do the same work, the
opcode counts say which instructions one of them issues in excess.

    python tools/ncu_sass.py SASS.csv [TOP]

A development tool (CPU); used in bench/results/nvidia-h100/mosaic-logits-epilogue/.
"""
import collections
import csv
import re
import sys


def kernels(path):
    """[(kernel name, header, rows)] of the CSV's per-kernel tables."""
    out = []
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            out.append((row[1], None, []))
        elif row and row[0] == "Address" and out:
            out[-1] = (out[-1][0], row, out[-1][2])
        elif out and out[-1][1] is not None and len(row) == len(out[-1][1]):
            out[-1][2].append(row)
    return out


def summary(name, header, rows, top=25):
    col = {n: i for i, n in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    executed, sampled, stalls, lines = collections.Counter(), collections.Counter(), collections.Counter(), []
    for r in rows:
        source = r[col["Source"]].strip()
        opcode = re.sub(r"^@!?U?P\w+\s+", "", source).split(" ")[0].split(".")[0]
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        count = int(r[col["Instructions Executed"]] or 0)
        executed[opcode] += count
        sampled[opcode] += samples
        stalls.update({k: int(r[col[k]] or 0) for k in reasons})
        lines.append((samples, source, count))
    n_exec, n_samples = max(sum(executed.values()), 1), max(sum(sampled.values()), 1)
    print(f"===== {name}: {n_exec} instructions executed, {n_samples} stall samples")
    print("executed by opcode:", ", ".join(f"{o} {c} ({100 * c / n_exec:.1f}%)" for o, c in executed.most_common(22)))
    print("samples by opcode:", ", ".join(f"{o} {100 * c / n_samples:.1f}%" for o, c in sampled.most_common(15)))
    print("samples by reason:", ", ".join(f"{o[6:]} {100 * c / n_samples:.1f}%" for o, c in stalls.most_common(10)))
    for samples, source, count in sorted(lines, reverse=True)[:top]:
        print(f"  {100 * samples / n_samples:5.1f}%  {source[:90]}  (executed {count})")


if __name__ == "__main__":
    for name, header, rows in kernels(sys.argv[1]):
        summary(name, header, rows, int(sys.argv[2]) if len(sys.argv) > 2 else 25)
