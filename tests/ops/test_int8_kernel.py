"""The int8 dense kernel against a float64 numpy reference on fresh random inputs (Pallas
interpret mode off the GPU, the Triton lowering on it), its tiling and `int8_linear`'s
dispatch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.ops import int8_kernel as i8
from strata_jax.ops.int8_kernel import Int8Tiles

INTERPRET = jax.default_backend() != "gpu"
SMALL = Int8Tiles(bk=64, bn=64, split_k=2)
# The kernel rounds twice in x's dtype (the float32 sum, then its product with the scale),
# each within the unit roundoff: 2**-8 for bfloat16 (8 significant bits), 2**-24 for float32.
# The float32 sums round too: an allowance of 1e-5 of the largest output for those.
RTOL = {jnp.bfloat16: 2 * 2.0**-8, jnp.float32: 1e-5}
ATOL = 1e-5


def _inputs(seed: int, m: int, k: int, n: int, dtype=jnp.bfloat16):
    """x [m, k] normal, w int8 [k, n] in [-127, 127], scale [n] bf16 around 1 / (std(w) *
    sqrt(k)) (outputs of order one)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, n) / (73 * np.sqrt(k)), jnp.bfloat16)
    return x, w, scale


def _reference(x, w, scale) -> np.ndarray:
    as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    return as64(x) @ (as64(w) * as64(scale))


def _xla(x, w, scale):
    return (x @ w.astype(x.dtype)) * scale.astype(x.dtype)


def _assert_close(got, ref: np.ndarray, dtype) -> None:
    err = np.abs(np.asarray(got, np.float64) - ref)
    bound = RTOL[dtype] * np.abs(ref) + ATOL * np.abs(ref).max()
    assert np.all(err <= bound), f"worst excess {(err - bound).max()}"


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_float64(m, dtype):
    x, w, scale = _inputs(m, m, 256, 192, dtype)  # N = 3 blocks of 64
    got = i8.int8_matmul(x, w, scale, tiles=SMALL, interpret=INTERPRET)
    assert got.shape == (m, 192) and got.dtype == dtype
    _assert_close(got, _reference(x, w, scale), dtype)


@pytest.mark.parametrize("k, n, tiles", [(128, 320, Int8Tiles(bk=32, bn=32, split_k=4)),
                                         (512, 96, Int8Tiles(bk=128, bn=32, split_k=1)),
                                         (256, 192, None)])  # None: int8_tiles_for's
def test_other_shapes_and_tiles_match_float64(k, n, tiles):
    x, w, scale = _inputs(k + n, 3, k, n)
    got = i8.int8_matmul(x, w, scale, tiles=tiles, interpret=INTERPRET)
    _assert_close(got, _reference(x, w, scale), jnp.bfloat16)


def test_kernel_rounds_as_the_xla_formula():
    """Same rounding sequence, other order of the float32 sum: at most a bf16 rounding apart."""
    x, w, scale = _inputs(7, 16, 256, 192)
    got = np.asarray(i8.int8_matmul(x, w, scale, tiles=SMALL, interpret=INTERPRET), np.float64)
    want = np.asarray(_xla(x, w, scale), np.float64)
    assert np.all(np.abs(got - want) <= RTOL[jnp.bfloat16] * np.abs(want)
                  + ATOL * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_are_independent(dtype):
    """Row 0 alone and beside 15 other random rows: the same bits."""
    x, w, scale = _inputs(11, 16, 256, 192, dtype)
    alone = i8.int8_matmul(x[:1], w, scale, tiles=SMALL, interpret=INTERPRET)
    batch = i8.int8_matmul(x, w, scale, tiles=SMALL, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch[0]))


@pytest.mark.parametrize("lead", [(5,), (2, 3), ()])
def test_int8_linear_dispatch(lead):
    x, w, scale = _inputs(13, int(np.prod(lead)), 256, 192)
    x = x.reshape(*lead, 256)
    got = i8.int8_linear(x, w, scale)
    assert got.shape == (*lead, 192) and got.dtype == x.dtype
    if jax.default_backend() == "gpu":
        want = i8.int8_matmul(x.reshape(-1, 256), w, scale).reshape(got.shape)
    else:  # the XLA formula, `model.linear`'s, bit for bit
        assert not i8.use_int8_kernel(x.size // 256, 256, 192)
        want = _xla(x, w, scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_int8_fits():
    assert i8.int8_fits(256, 192, SMALL)
    assert not i8.int8_fits(256, 200, SMALL)  # N not whole bn blocks
    assert not i8.int8_fits(256, 192, dataclasses.replace(SMALL, split_k=8))  # 4 steps in 8 parts
    assert not i8.int8_fits(192, 192, SMALL)  # 3 steps in 2 parts
    assert not i8.int8_fits(240, 192, dataclasses.replace(SMALL, bk=48, split_k=1))  # not 2**i
    assert not i8.int8_fits(256, 192, dataclasses.replace(SMALL, bn=8))  # below a Triton dot


def test_int8_tiles_for():
    # Mixtral-8x7B: at least TARGET_PROGRAMS programs, the fewest splits that get there
    assert i8.int8_tiles_for(4096, 6144) == Int8Tiles(bk=256, bn=64, split_k=4)
    assert i8.int8_tiles_for(4096, 4096) == Int8Tiles(bk=256, bn=64, split_k=8)
    assert i8.int8_tiles_for(4096, 14336) == Int8Tiles(bk=256, bn=64, split_k=2)
    assert i8.int8_tiles_for(4096, 4096 + 32).bn == 32  # smaller blocks where N does not divide
    assert i8.int8_tiles_for(4000, 4096).bk == 32
    assert i8.int8_tiles_for(4096, 100) is None and i8.int8_tiles_for(1000, 4096) is None
    for k, n in [(4096, 6144), (4096, 4128), (4000, 4096), (256, 192), (128, 48)]:
        assert i8.int8_fits(k, n, i8.int8_tiles_for(k, n))


def test_kernel_rejects_what_it_cannot_run():
    x, w, scale = _inputs(17, 33, 256, 192)
    with pytest.raises(ValueError, match="rows"):
        i8.int8_matmul(x, w, scale, tiles=SMALL, interpret=INTERPRET)
    with pytest.raises(ValueError, match="split_k"):
        i8.int8_matmul(x[:4], w, scale, tiles=dataclasses.replace(SMALL, split_k=8),
                       interpret=INTERPRET)
    with pytest.raises(ValueError, match="int8"):
        i8.int8_matmul(x[:4], w.astype(jnp.int16), scale, tiles=SMALL, interpret=INTERPRET)
