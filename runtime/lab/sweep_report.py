"""The report of a sweep (`strata_runtime.lab.sweep`): its rows as a markdown table
(`sweep.md`) and a plot (`sweep.png`: tok/s per rung, and each rung's time per program call
split as the stats allow)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from strata_runtime.lab.bench import interval_text
from strata_runtime.lab.cost_model import bound_link_gbps, link_name, prediction_error, time_split


def prediction_text(row: dict[str, Any]) -> str:
    """'tok/s (binding resource, error against measured)' of a row's prediction; '' if none."""
    p, err = row["predicted"], prediction_error(row)
    if p is None:
        return ""
    return f"{p['tok_s']:.4g} ({p['binding']}" + ("" if err is None else f", {err:+.0%}") + ")"


def _first_ok(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if "tok_s" in r), None)


HEADER = ("| rung | tok/s median [95 % CI] | x first | bound tok/s | achieved / bound (binds) "
          "| decode tok/s | predicted decode tok/s (binds, vs measured) | tier-0 hit "
          "| prefetch hit | h2d GB/step | step link GB/s (copies) | disk stalls s (loads) "
          "| routed GB/s (x link, x DRAM) | prefill tok/s (MB copied per token) |")


def table_line(row: dict[str, Any], first: dict[str, Any] | None) -> str:
    if "tok_s" not in row:
        why = row.get("error") or row.get("skipped")
        return f"| {row['rung']} | {why} |" + " |" * (HEADER.count("|") - 3)
    b = row["bound"]
    x = row["tok_s"]["median"] / first["tok_s"]["median"] if first else None
    pred = prediction_text(row) or "-"
    ratio = "-" if b["ratio"] is None else f"{b['ratio']:.2f} ({b['binds']})"

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    link = row.get("step_link")
    link_text = "-" if not link else f"{link['gbps']:.3g} ({link['copies']})"

    return (f"| {row['rung']} | {interval_text(row['tok_s'])} | "
            f"{'-' if x is None else f'{x:.2f}x'} | {b['bound_tok_s']:.4g} | {ratio} | "
            f"{interval_text(row['decode_tok_s'])} | {pred} | {rate(row['tier0_hit_rate'])} | "
            f"{rate(row['prefetch_hit_rate'])} | {row['per_step']['h2d_GB']:.4g} | "
            f"{link_text} | {row['disk_stall_s']:.3g} ({row['disk_loads']:g}) | "
            f"{_routed_text(row)} | {_prefill_text(row)} |")


def _prefill_text(row: dict[str, Any]) -> str:
    tok_s = row.get("prefill_tok_s")
    if not tok_s:
        return "-"
    copied = row.get("prefill_h2d_MB_per_token")
    return f"{interval_text(tok_s)}" + ("" if copied is None else f" ({copied:.3g})")


def _routed_text(row: dict[str, Any]) -> str:
    """The decode steps' effective routed-expert bandwidth over the link and host DRAM reads
    (`counting.routed_gbps`), as the write-up's peers report it."""
    gbps, c = row.get("routed_gbps"), row["ceilings"]
    if gbps is None:
        return "-"
    link = bound_link_gbps(c, row.get("step_link"))
    return (f"{gbps:.3g} ({gbps / link:.2f}x, {gbps / c['host_read_gbps']:.2f}x)"
            if link and c["host_read_gbps"] else f"{gbps:.3g}")


def _provenance(rows: list[dict[str, Any]]) -> list[str]:
    """A line naming each row's run, when the rows come from more than one (a --resume or
    --rung run keeps the rows of earlier ones)."""
    runs = {}
    for r in rows:
        if "tok_s" in r:
            fp = r["fingerprint"]
            commit = ((fp.get("git") or {}).get("commit") or "-")[:12]
            dirty = " (dirty)" if (fp.get("git") or {}).get("dirty") else ""
            runs[r["rung"]] = f"{commit}{dirty} on {fp['gpu']}, {fp['date'][:16]}"
    if len(set(runs.values())) <= 1:
        return []
    return ["Rows of more than one run (the header is the first's): "
            + "; ".join(f"{name}: {run}" for name, run in runs.items()) + ".", ""]


def render_table(rows: list[dict[str, Any]], title: str = "sweep") -> str:
    first = _first_ok(rows)
    lines = [f"# {title}", ""]
    if first is not None:
        fp, c, st = first["fingerprint"], first["ceilings"], first["settings"]
        commit = (fp.get("git") or {}).get("commit") or "-"
        lines += [
            f"{fp['gpu']} ({fp['device_kind']}), jax {fp['jax']} / jaxlib {fp['jaxlib']}, "
            f"{fp['host_cores']} host cores, NUMA nodes {fp['numa_nodes']}, PCIe gen "
            f"{fp['pcie_gen'] or '-'}, python {fp['python']}, commit {commit[:12]}, "
            f"{fp['date']}.",
            "",
            *_provenance(rows),
            "Ceilings measured right before each rung (the first rung's; each row's JSON has "
            f"its own): pinned host->device {c['pinned_h2d_gbps']:.3g} "
            f"GB/s, host read {c['host_read_gbps']:.3g} GB/s, device read "
            f"{c['hbm_read_gbps']:.4g} GB/s, matmul {c['matmul_tflops']:.3g} TFLOP/s "
            f"({c['matmul_dtype']}). Each rung: {st['prompts']} synthetic prompts of "
            f"{st['prompt_len']} ids (seed {first['seed']}), {st['new']} new tokens each, "
            f"{st['repeats']} repeats after a warm-up (first rung's settings; each row's JSON "
            "has its own).",
            "",
            "tok/s = generated tokens / wall of the timed generate (prefill included); the "
            f"interval is a {first['tok_s']['method']}. Bound = generated tokens / (max(HBM "
            "bytes / device read, FLOPs / matmul) + host->device bytes / link + disk bytes / "
            "the faster of the cold and warm expert reads), from the bytes counted in the run; "
            "link = the faster of the ceiling and the rung's step link (as many of its experts "
            "as a layer of its warm-up copied, by the step's own copy out of its tier 1); "
            "binds = the largest "
            "term. Predicted = the cost model (runtime/lab/cost_model.py) on the measured "
            "ceilings, "
            "the step link and the rates of the rung's expert kernel and of its step without "
            "experts (timed on its engine), from the decode steps' counts of every repeat (disk "
            "loads at the rate those loads achieved, with the layers they ran again); its error is "
            "against the decode tok/s of the same steps (every repeat's decode tokens / their "
            "decode seconds), not the median. h2d GB/step: per program call (decode step or "
            "prefill chunk); disk stalls: per repeat.",
            "",
        ]
    lines += [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [table_line(r, first) for r in rows]
    return "\n".join(lines) + "\n"


PARTS = (  # (key, colour, legend) of the time split, bottom to top
    ("dense", "tab:green", "dense weights and KV cache (estimate: bytes / the rate of the "
                           "step without experts, else the device read)"),
    ("experts", "tab:olive", "routed experts (estimate: bytes / the expert kernel's rate, "
                             "dequant included)"),
    ("rest", "tab:gray", "the rest (measured minus the others: routing, sampling, host round "
                         "trips, gaps)"),
    ("copies", "tab:orange", "host->device copies (estimate: counted bytes / measured {link} "
                             "rate)"),
    ("disk", "tab:red", "disk stalls (measured)"))


def plot(rows: list[dict[str, Any]], path: str | Path, title: str = "sweep") -> bool:
    """tok/s per rung (median, interval, bound) and each rung's engine time per program call
    as shares of it (`cost_model.time_split`), its ms written above the bar: rungs far apart in
    speed stay readable side by side. False: no matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in rows if "tok_s" in r]
    names = [r["rung"] for r in ok]
    x = np.arange(len(ok))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 1.4 * len(ok) + 4), 6.0))
    med = np.array([r["tok_s"]["median"] for r in ok])
    err = np.array([[r["tok_s"]["median"] - r["tok_s"]["lo"],
                     r["tok_s"]["hi"] - r["tok_s"]["median"]] for r in ok]).T.reshape(2, -1)
    left.bar(x, med, yerr=err, capsize=3, color="tab:blue", label="tok/s, median [95 % CI]")
    bounds = [r["bound"]["bound_tok_s"] or np.nan for r in ok]
    left.plot(x, bounds, "k_", markersize=18, label="bound (counted bytes / ceilings)")
    spread = float(np.nanmax(med) / np.nanmin(med)) if len(med) and np.nanmin(med) > 0 else 1.0
    if spread > 20:  # a ladder's first rungs would be invisible beside its last on a linear axis
        left.set_yscale("log")
    left.set_ylabel("tok/s" + (" (log scale)" if spread > 20 else ""))
    left.set_title("throughput per rung")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))

    splits = [time_split(r) for r in ok]
    totals = np.array([max(r["per_step"]["ms_engine"], 1e-12) for r in ok])
    link = (link_name(ok[0]["ceilings"]["pinned_h2d_gbps"], ok[0]["ceilings"]["host_read_gbps"])
            if ok else "pcie")
    bottom = np.zeros(len(ok))
    for key, colour, label in PARTS:
        share = 100 * np.array([s[key] for s in splits]) / totals
        right.bar(x, share, bottom=bottom, color=colour, label=label.format(link=link))
        bottom += share
    for xi, ms in zip(x, totals, strict=True):
        right.text(xi, 101, f"{ms:.3g} ms", ha="center", va="bottom", fontsize=7)
    right.set_ylim(0, 110)
    right.set_ylabel("% of the engine's time per call")
    right.set_title("engine time per program call (decode step or prefill chunk)", fontsize=9)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    for ax in (left, right):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def finish(rows: list[dict[str, Any]], out: str | Path, title: str) -> str:
    """Write sweep.md and sweep.png of `rows`; returns the table."""
    out = Path(out)
    text = render_table(rows, title)
    (out / "sweep.md").write_text(text)
    if not plot(rows, out / "sweep.png", title):
        print("warning: no matplotlib: sweep.png not written (it is in the lock, requirements.txt)",
              file=sys.stderr)
    return text
