"""Ops: the array kernels a step runs (layers, the expert pool, the expert kernels with their int4
/ int8 variants) and the host kernel that computes misses on the CPU, with its worker registry.
Imports `formats` only.

Each Pallas kernel owns its tiles: `expert_kernels.FloatTiles` / `float_tiles_for` (Triton,
float expert pools), `int4_kernel.Int4Tiles` / `int4_tiles_for` / `int4_fits` (Mosaic GPU,
int4 expert pools), `int8_kernel.Int8Tiles` / `int8_tiles_for` / `int8_fits` (Triton, int8
dense matrices). Three types, not one: the kernels take different parameters, under different
rules of what divides a shape."""
