# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Ablations on the H200: what each technique buys, against its bound and the cost model
# The committed H200 results of the one-program decode step (`benchmarks/step_decode.py`,
# synthetic Mixtral-8x7B shape, 8 layers): every row's tok/s beside the bound from the bytes
# its own records count, and, for the miss remedies (copy over the link, compute on the
# host, or split each layer between the two), beside the hybrid bound and what the cost model
# (`strata_runtime.lab.cost_model`, profile `h200-pcie5`) predicts from the same counted experts.
# Nothing here runs on a GPU: it reads `benchmarks/results/`.

# %%
import json
import sys
from pathlib import Path

import matplotlib

import strata_jax

ROOT = Path(strata_jax.__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks package lives beside the library

from benchmarks.step_decode import bounds  # noqa: E402
from strata_runtime.lab.cost_model import ModelCost, predict, profile  # noqa: E402

matplotlib.use("Agg")  # before pyplot: no display in CI
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line]


step = rows("step_decode.jsonl")
hybrid = rows("step_decode_hybrid.jsonl")
print(f"{len(step)} rows of the step benchmark, {len(hybrid)} of the miss remedies; "
      f"{step[0]['machine']['device']}, JAX {step[0]['machine']['jax']}")

# %% [markdown]
# ## The step at each budget: measured against its bound
# The bound of a row is B over (HBM bytes / HBM bandwidth + bytes over the link / link rate),
# both measured in the same run; "binds" names the larger term.

# %%
print("| row | B | predictor | tok/s | bound | ratio | binds |")
print("|---|---|---|---|---|---|---|")
for r in step:
    b = bounds(r)
    print(f"| {r['row']} | {r['batch']} | {r['predictor']} | {r['tok_s']:.1f} | "
          f"{b['bound_tok_s']:.1f} | {b['ratio']:.2f} | {b['binds']} |")

# %%
fig, ax = plt.subplots(figsize=(9, 3.5))
labels = [f"{r['row']}\nB={r['batch']} {r['predictor']}" for r in step]
x = range(len(step))
ax.bar(x, [r["tok_s"] for r in step], label="measured")
ax.scatter(x, [bounds(r)["bound_tok_s"] for r in step], color="k", marker="_", s=400,
           label="bound (counted bytes)", zorder=3)
ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
ax.set_yscale("log")
ax.set_ylabel("tok/s")
ax.legend()
fig.tight_layout()
fig.savefig("step_rows.png", dpi=110)
print("saved step_rows.png")

# %% [markdown]
# ## A miss's remedies: fetch, host, auto
# bf16 experts under an 8 GiB budget. The hybrid bound moves the misses' bytes over the link
# and the host's plain-read rate at once; the prediction is the cost model's, from the row's
# own counts (copied and host-computed experts per step) on the `h200-pcie5` profile.

# %%
hw = profile("h200-pcie5")
print("| B | miss | tok/s | predicted | binding | hybrid bound | host-computed/step |")
print("|---|---|---|---|---|---|---|")
predicted = []
for r in hybrid:
    c, b = r["counts"], bounds(r)
    cost = ModelCost(bytes_per_expert=r["bytes_per_expert"], dense_bytes=r["dense_bytes"],
                     flops_per_token=0.0)
    p = predict(hw, cost, batch=r["batch"], routed=c["distinct"], misses=c["fetched"],
                hosted=c.get("hosted", 0.0), extra_hbm_bytes=r["kv_bytes"])
    predicted.append(p.tok_s)
    hb = "-" if b["hybrid_bound_tok_s"] is None else f"{b['hybrid_bound_tok_s']:.1f}"
    print(f"| {r['batch']} | {r['miss']} | {r['tok_s']:.1f} | {p.tok_s:.1f} | {p.binding} | "
          f"{hb} | {c.get('hosted', 0.0):.1f} |")

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3))
for ax, batch in zip(axes, (1, 16), strict=True):
    sel = [(r, p) for r, p in zip(hybrid, predicted, strict=True) if r["batch"] == batch]
    names = [r["miss"] for r, _ in sel]
    ax.bar(names, [r["tok_s"] for r, _ in sel], label="measured")
    ax.scatter(names, [p for _, p in sel], color="C1", zorder=3, label="cost model")
    ax.set_title(f"bf16, 8 GiB, B={batch}")
    ax.set_ylabel("tok/s")
axes[0].legend()
fig.tight_layout()
fig.savefig("miss_remedies.png", dpi=110)
print("saved miss_remedies.png")
