"""The int4 kernel's input order (CPU): what `permute_k` must be for the register view to work.

The Mosaic kernel itself runs on Hopper only (tests/ops/test_expert_kernels.py, against float64)."""

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.ops.int4_kernel import (
    _F16_PAIR,
    _join_cut_tiles,
    _operand,
    _run_of_steps,
    as_f16,
    permute_k,
)


def _view_columns(f16: bool = False) -> np.ndarray:
    """For each physical input p of a 32-block, the logical input the kernel multiplies it by:
    lane c (of 4 per row) loads physical 8c .. 8c+7 as one word (UPCAST_4X) and wgmma reads its
    pair a as logical 8a + 2c + {0, 1} (WGMMA layout); pair a holds the word's elements 2a, 2a + 1
    (bf16) or a, a + 4 (f16)."""
    logical = np.empty(32, np.int64)
    for c, e in np.ndindex(4, 8):  # element e of lane c's word: its pair a and half b
        a, b = (e % 4, e // 4) if f16 else (e // 2, e % 2)
        logical[8 * c + e] = 8 * a + 2 * c + b
    return logical


@pytest.mark.parametrize("f16", [False, True])
def test_permute_k_feeds_each_weight_its_own_input(f16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 128)).astype(np.float32)
    w = rng.normal(size=(5, 128)).astype(np.float32)
    logical = np.concatenate([_view_columns(f16) + 32 * b for b in range(4)])
    w_view = np.empty_like(w)
    w_view[:, logical] = w  # the weights as the kernel's wgmma sees them
    x_in = np.asarray(permute_k(jnp.asarray(x), f16=f16))
    np.testing.assert_array_equal(x_in[:, logical], x)
    np.testing.assert_allclose(x_in @ w_view.T, x @ w.T, rtol=0, atol=1e-4)


def test_permute_k_is_an_involution_within_32_blocks():
    x = jnp.arange(2 * 96, dtype=jnp.float32).reshape(2, 96)
    y = permute_k(x)
    np.testing.assert_array_equal(permute_k(y), x)
    assert not np.array_equal(y, x)
    blocks = np.asarray(y).reshape(2, 3, 32)
    np.testing.assert_array_equal(np.sort(blocks, axis=-1), np.asarray(x).reshape(2, 3, 32))


def _lop3_6a(a: int, b: int, c: int) -> int:
    """PTX lop3.b32 with immLut 0x6a: (b ? a ^ c : c), bit by bit."""
    return (b & (a ^ c)) | (~b & c) & 0xFFFFFFFF


def _f16_pair(bits: int, program: str) -> list[float]:
    """The two float16 halves of one `_F16_PAIR` program run on a 32-bit word."""
    _, lop3, *_ = program.split(";")
    mask, magic = (int(v, 16) for v in lop3.replace(",", " ").split()[3:5])
    t = np.array([_lop3_6a(bits, mask, magic)], np.uint32).view(np.float16).astype(np.float64)
    if "sub.f16x2" in program:
        return list(t - 1032.0)
    return list(t * (1 / 16) - 72.0)  # fma.rn, exact here: the result is a small int


def test_f16_conversion_gives_each_pair_its_two_nibbles():
    """`Int4Tiles(f16=True)`'s shift + lop3 + sub/fma, bit for bit: pair a of a word is the
    int4 values of its nibbles a and a + 4 as float16."""
    rng = np.random.default_rng(1)
    for word in [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF, *map(int, rng.integers(0, 2**32, 20))]:
        nibbles = [(word >> (4 * e)) & 0xF for e in range(8)]
        q = [n - 16 if n >= 8 else n for n in nibbles]  # two's complement int4
        for a in range(4):
            bits = word >> 8 if a >= 2 else word
            assert _f16_pair(bits, _F16_PAIR[a % 2]) == [q[a], q[a + 4]], (hex(word), a)


def test_f16_operand_is_exact_and_inside_float16_range():
    rng = np.random.default_rng(2)
    for magnitude in (1e-3, 1.0, 3e4, 1e30):
        x = jnp.asarray(rng.normal(size=(2, 5, 64)) * magnitude, jnp.bfloat16)
        h, inv = as_f16(x)
        assert h.dtype == jnp.float16 and float(jnp.max(jnp.abs(h))) < 2.0**15
        np.testing.assert_array_equal(np.asarray(h, np.float32) * float(inv[0]),
                                      np.asarray(x, np.float32))
    h, inv = as_f16(jnp.zeros((3, 8), jnp.bfloat16))  # all zero: no NaN
    assert np.all(np.asarray(h) == 0) and np.isfinite(inv).all()


def test_operand_ignores_invalid_entries_when_scaling():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 8, 64)), jnp.bfloat16)
    garbage = x.at[1].set(jnp.nan).at[2].set(1e30)
    h, inv = _operand(garbage, True, jnp.array([True, False, False]))
    want, want_inv = as_f16(permute_k(x[:1], f16=True))
    np.testing.assert_array_equal(np.asarray(h[:1]), np.asarray(want))
    assert float(inv[0]) == float(want_inv[0]) and np.all(np.asarray(h[1:]) == 0)


def _stream_k_launch(sums, order, n_valid, ctas, k_steps, epilogue):
    """What the stream-K kernel writes, step by step as its CTAs run (`int4_matmul_t`): each
    step adds its part; a tile's end writes epilogue(sum) in place, or the sum as the tail of
    a tile begun by the previous CTA; a run's end inside a tile writes the sum as its head."""
    c_n, nw, blocks, rows, r, _ = sums.shape  # each step's part: sums[..., step]
    out = np.full((c_n, 1, blocks, rows, r), np.nan, np.float32)  # one output: the epilogue's
    carry = np.full((2, ctas, nw, rows, r), np.nan, np.float32)
    steps = int(n_valid) * blocks * k_steps
    for p in range(ctas):
        first, mine = (int(v) for v in _run_of_steps(p, steps, ctas, k_steps))
        acc = np.zeros((nw, rows, r), np.float32)
        for i in range(mine):
            tile, kk = divmod(first + i, k_steps)
            entry, block = order[tile // blocks], tile % blocks
            acc += sums[entry, :, block, ..., kk]
            ends, began_before = kk == k_steps - 1, i < kk
            if ends and began_before:
                carry[1, p], acc = acc, np.zeros_like(acc)
            elif ends:
                out[entry, :, block], acc = np.stack(epilogue(*acc)), np.zeros_like(acc)
            elif i == mine - 1:
                carry[0, p] = acc
    return out, carry


@pytest.mark.parametrize(("n_valid", "ctas", "k_steps", "cut"),
                         [(5, 7, 3, True), (6, 16, 2, True), (2, 5, 4, True), (2, 3, 5, False),
                          (6, 4, 1, False), (0, 4, 3, False)])
def test_stream_k_cut_tiles_join_to_whole_tiles(n_valid, ctas, k_steps, cut):
    """Equal runs of steps cut some tiles between two CTAs; joined after the kernel, every valid
    entry's tiles equal epilogue(the whole sum), in place, and invalid entries stay unwritten."""
    rng = np.random.default_rng(n_valid * 100 + ctas)
    c_n, nw, blocks = 6, 2, 3
    sums = rng.normal(size=(c_n, nw, blocks, 4, 3, k_steps)).astype(np.float32)
    valid = rng.permutation(np.arange(c_n) < n_valid)
    order = np.argsort(~valid, kind="stable")
    epilogue = lambda g, u: (g * u,)  # noqa: E731
    out, carry = _stream_k_launch(sums, order, n_valid, ctas, k_steps, epilogue)
    joined = np.asarray(_join_cut_tiles(jnp.asarray(out), jnp.asarray(carry), jnp.asarray(order),
                                        jnp.int32(n_valid), k_steps, epilogue))
    whole = sums.sum(-1)
    np.testing.assert_allclose(joined[valid, 0], (whole[:, 0] * whole[:, 1])[valid], rtol=1e-5)
    assert np.isnan(joined[~valid]).all()
    firsts = [int(_run_of_steps(p, n_valid * blocks * k_steps, ctas, k_steps)[0])
              for p in range(ctas)]
    assert any(f % k_steps for f in firsts) == cut
