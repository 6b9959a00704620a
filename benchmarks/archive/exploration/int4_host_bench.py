import sys, time, os
import numpy as np, ml_dtypes
sys.path.insert(0, os.environ.get("TREE", "/work/wt"))
from strata_jax.ops import host_kernel as hk
print(hk.__file__)
D, F = int(os.environ.get("D", 4096)), int(os.environ.get("F", 14336)); R, B, G = 64, 256, 128
rng = np.random.default_rng(0)
def expert():
    w1 = rng.integers(0, 256, (F // R, D // B, R, B // 2), dtype=np.uint8)
    w3 = rng.integers(0, 256, (F // R, D // B, R, B // 2), dtype=np.uint8)
    w2 = rng.integers(0, 256, (D // R, F // B, R, B // 2), dtype=np.uint8)
    s = lambda a, b: (rng.random((a, b), np.float32) * 0.01 + 0.001).astype(ml_dtypes.bfloat16)
    return w1, s(D // G, F), w3, s(D // G, F), w2, s(F // G, D)
E = int(os.environ.get("E", 4))
ex = [expert() for _ in range(E)]
nbytes = sum(a.nbytes for a in ex[0])
threads = int(os.environ.get("T", 1))
for rows in [int(r) for r in os.environ.get("ROWS", "1,4").split(",")]:
    x = rng.standard_normal((rows, D), np.float32).astype(ml_dtypes.bfloat16)
    hk.swiglu_int4(*ex[0], x, threads=threads, march=os.environ.get("MARCH"))
    ts = []
    for i in range(int(os.environ.get("N", 8))):
        t = time.perf_counter(); hk.swiglu_int4(*ex[i % E], x, threads=threads, march=os.environ.get("MARCH")); ts.append(time.perf_counter() - t)
    t = np.median(ts)
    print(f"rows {rows} threads {threads}: {t*1e3:.2f} ms/expert {nbytes/t/1e9:.2f} GB/s")
ts = []
for i in range(8):
    t = time.perf_counter(); [a.view(np.uint64).sum() for a in ex[i % E][::2]]; ts.append(time.perf_counter() - t)
print(f"plain read 1 thread: {nbytes/np.median(ts)/1e9:.2f} GB/s")
