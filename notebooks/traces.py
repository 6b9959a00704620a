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
# # Routing traces: statistics, cache policies vs Belady
# Synthesize a decode trace whose expert popularity is skewed and shifts halfway through,
# look at its statistics, then replay it through the engine's cache policies and compare each
# with Belady's optimum on the same pinned set and cache slots (docs/design.md, "Traces and
# the simulator").

# %%
import tempfile
from pathlib import Path

import matplotlib

from strata_jax.tools.synth import SHAPES
from strata_runtime.engine.trace import load_trace, save_trace, synthetic_trace, trace_stats
from strata_runtime.lab.cost_model import PROFILES, model_cost
from strata_runtime.lab.simulate import compare, pinned_by_heat, predict_replay
from strata_runtime.residency.cache_policy import POLICIES

matplotlib.use("Agg")  # before pyplot: no display in CI
import matplotlib.pyplot as plt  # noqa: E402

workdir = Path(tempfile.mkdtemp())
LAYERS, EXPERTS, TOP_K = 4, 16, 2  # the tiny shape's experts and top-k, 4 layers
trace = synthetic_trace(LAYERS, EXPERTS, TOP_K, steps=300, rows=4, skew=1.2, seed=0,
                        drift_at=150)
save_trace(workdir / "drift.npz", trace)
trace = load_trace(workdir / "drift.npz")
print(f"{trace.num_steps} steps, {int(trace.live_rows().sum())} rows, "
      f"{(workdir / 'drift.npz').stat().st_size} bytes on disk")

# %% [markdown]
# ## Statistics
# Per layer: experts routed at all, the entropy of the routing distribution (4 bits would be
# uniform over 16), the share of the 8 most-routed. The reuse distance of an access is the
# number of distinct other (layer, expert) keys since its previous use: an LRU cache of C
# slots alone hits exactly the re-accesses at distance < C.

# %%
stats = trace_stats(trace)
print(stats.render())

# %% [markdown]
# ## Policies vs Belady
# Four of the hottest experts pinned (by the trace's own heat, as the engine ranks them with
# `--heat`), a range of cache slots, the engine's admission (a step's experts enter the cache
# after the next step). Belady's optimum sees the future and may skip admitting an expert.

# %%
pinned = pinned_by_heat(trace, 4)
sizes = [0, 2, 4, 8, 16, 24, 32, 48]
rates = {name: [] for name in [*POLICIES, "belady"]}
for cache in sizes:
    results, opt = compare(trace, POLICIES, pinned=pinned, cache=cache, staging=2)
    for r in [*results, opt]:
        rates[r.name].append(r.hit_rate)
    assert all(opt.hits >= r.hits for r in results)

print("| cache slots | " + " | ".join(rates) + " |")
print("|---" * (len(rates) + 1) + "|")
for i, cache in enumerate(sizes):
    print(f"| {cache} | " + " | ".join(f"{rates[n][i]:.3f}" for n in rates) + " |")

# %% [markdown]
# ## Hit rate over time, and a prediction
# With 16 cache slots: the hit rate of each 25-step window. The pinned set was chosen from
# the whole trace, so it matches neither half well; the cache has to follow the drift. Then
# the cost model's decode tok/s on the H200 profile for the tiny model's expert size. Its
# copies include the engine's admissions (each admitted expert is copied into its slot
# again), so a cache that keeps re-admitting can predict slower than no cache at all.

# %%
results, opt = compare(trace, POLICIES, pinned=pinned, cache=16, staging=2)
window = 25
accesses = [len(trace.step_keys(s)) for s in range(trace.num_steps)]


def windowed(r):
    misses = r.layer_misses.sum(axis=1)
    return [1 - misses[i : i + window].sum() / sum(accesses[i : i + window])
            for i in range(0, trace.num_steps, window)]


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
for name in rates:
    ax1.plot(sizes, rates[name], marker="o", label=name, linestyle="--" if name == "belady"
             else "-")
ax1.set(xlabel="cache slots", ylabel="hit rate", title="4 pinned + cache slots")
ax1.legend()
for r in [*results, opt]:
    ax2.plot(range(0, trace.num_steps, window), windowed(r), label=r.name)
ax2.axvline(150, color="grey", linewidth=0.8)
ax2.set(xlabel="step", ylabel="hit rate (25-step window)", title="popularity drifts at 150")
fig.tight_layout()
fig.savefig(workdir / "traces.png", dpi=80)
print("saved", workdir / "traces.png")

cost = model_cost(SHAPES["tiny"].replace(num_layers=LAYERS))
for r in [*results, opt]:
    p = predict_replay(PROFILES["h200-pcie5"], cost, trace, r)
    print(f"{r.name:>6}: hit rate {r.hit_rate:.3f}, copies/step {r.copies / trace.num_steps:.1f}, "
          f"prefetch bound {r.prefetch_bound:.3f}, predicted {p.tok_s:,.0f} tok/s ({p.binding})")
