"""Exploration (session 10): where the int4 kernels' warps wait, per SASS instruction.

Reads the CSV that `ncu -i REPORT --page source --print-source sass --csv` writes for a report
taken with `--section SourceCounters` (`run_h200_int4_sass.sh`) and prints, per kernel, the
share of warp-stall samples by reason and the instructions holding the most samples.

    python3 benchmarks/exploration/ncu_stalls.py ncu_qwen3_sass.csv [top]
"""
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str) -> list[dict]:
    """Per kernel in the CSV: its name, column header and instruction rows."""
    out: list[dict] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                out.append({"name": row[1], "header": None, "rows": []})
            elif out and row and row[0] == "Address":
                out[-1]["header"] = row
            elif out and row and out[-1]["header"]:
                out[-1]["rows"].append(row)
    return out


def count(cell: str) -> int:
    try:
        return int(cell or 0)
    except ValueError:
        return 0


def report(kernel: dict, top: int) -> list[str]:
    col = {name: i for i, name in enumerate(kernel["header"])}
    reasons = [n for n in col if n.startswith("stall_") and "Not Issued" not in n]
    by_reason: collections.Counter = collections.Counter()
    rows = []
    for r in kernel["rows"]:
        by_reason.update({n[6:]: count(r[col[n]]) for n in reasons})
        rows.append((count(r[col[SAMPLES]]), r[col["Source"]].strip(),
                     {n[6:]: count(r[col[n]]) for n in reasons if count(r[col[n]])}))
    total = max(1, sum(s for s, _, _ in rows))
    lines = [f"## {kernel['name']}: {total} samples", "",
             "by reason: " + ", ".join(f"{n} {v / total:.2f}"
                                       for n, v in by_reason.most_common(8)), ""]
    lines += [f"    {s / total:.3f}  {src[:60]:60s} {why}"
              for s, src, why in sorted(rows, key=lambda t: -t[0])[:top]]
    return lines + [""]


if __name__ == "__main__":
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    for k in kernels(sys.argv[1]):
        print("\n".join(report(k, top)))
