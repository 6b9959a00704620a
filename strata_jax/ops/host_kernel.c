/* The host expert kernel: (silu(x @ w1) * (x @ w3)) @ w2 for r rows of one expert whose
 * weights lie in host memory, on the host cores (strata_jax/host_kernel.py builds and binds it;
 * docs/design.md, "Host compute of misses").
 *
 * The work is a matrix-vector product bound by the weight bytes read, so the layout of the
 * reads is what matters. Float weights are row-major [in, out]. Each thread takes a range of
 * weight rows (`plan`: and a range of columns too, only where its partial sums would outgrow
 * its L2), reads them in panels of a few rows side by side, each panel in strips of 32 columns,
 * with the accumulators of a block of x rows by 32 columns in registers over the panel; the
 * threads' partial sums are added after a barrier. A thread's weight rows are then long
 * ascending runs the hardware prefetchers follow; a column range per thread would be a short
 * run every matrix row apart, which they do not follow. x row blocks after the first find the
 * strip in L1, so every weight byte comes from memory once.
 *
 * Packed int4 weights are output-major ([out, in/2], two inputs a byte; strata_jax/quant.py),
 * so there each output column is a dot product over contiguous bytes; a group's scale makes a
 * 16-entry table of q * s, which dequantizes a nibble in one permute (float32 tables, or with
 * more rows bf16 ones for vdpbf16ps: q * s rounded to bf16, as the device dequantizes).
 *
 * Rounding points, as the device kernels: gate and up products accumulate in float32,
 * silu(gate) * up is rounded to the activations' dtype before the down projection, the output
 * is float32. AVX-512 paths (with vdpbf16ps for bf16 weights and activations where the CPU has
 * AVX512-BF16) sit beside portable C that the compiler vectorizes for whatever -march=native
 * gives.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HK_AVX512 1
#if defined(__AVX512BF16__)
#define HK_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HK_AMX 1
#endif
#endif
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define PD 2    /* strips ahead that each weight row is prefetched */
#define PART_BYTES (256 * 1024) /* a thread's partial sums: kept within its L2 */
#define NC 32   /* columns of a micro-kernel */
#define RB 12   /* rows of x held in registers by a micro-kernel */

static inline float as_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_u32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_f32(uint16_t h) { return as_f32((uint32_t)h << 16); }

/* Round to nearest even; a NaN stays a (quiet) NaN. Branch-free, so loops vectorize. */
static inline uint16_t f32_bf16(float f) {
    uint32_t u = as_u32(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static inline float f16_f32(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fff) << 13, exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0f800000u) {
        o += (uint32_t)(128 - 16) << 23; /* inf, nan */
    } else if (exp == 0) {               /* subnormal: renormalize */
        o += 1u << 23;
        o = as_u32(as_f32(o) - as_f32(113u << 23));
    }
    return as_f32(o | ((uint32_t)(h & 0x8000) << 16));
}

static inline uint16_t f32_f16(float fl) { /* round to nearest even */
    uint32_t f = as_u32(fl), sign = f & 0x80000000u, o;
    f ^= sign;
    if (f >= (143u << 23)) {
        o = f > (255u << 23) ? 0x7e00 : 0x7c00;
    } else if (f < (113u << 23)) {
        float magic = as_f32(126u << 23);
        o = as_u32(as_f32(f) + magic) - as_u32(magic);
    } else {
        uint32_t odd = (f >> 13) & 1;
        f += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
        o = f >> 13;
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float load_f32(const void *p, long i, int dt) {
    if (dt == DT_BF16) return bf16_f32(((const uint16_t *)p)[i]);
    if (dt == DT_F16) return f16_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* exp on [-87, 88] (clamped: silu needs no more) by the Cephes polynomial, branch-free. */
static inline float hk_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504f + 12582912.0f; /* 1.5 * 2^23: rounds to an integer */
    float n = t - 12582912.0f;
    int32_t ni = (int32_t)as_u32(t) - 0x4b400000;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * as_f32((uint32_t)(ni + 127) << 23);
}

/* ------------------------------------------------------------------ scratch buffers */

/* Grown per thread and kept: the OpenMP team and the calling thread live on, and a fresh
 * allocation each call would fault its pages in again. */
typedef struct { void *p; size_t n; } buf_t;

static void *grow(buf_t *b, size_t n) {
    if (b->n < n) {
        free(b->p);
        n = (n + 4095) & ~(size_t)4095;
        b->p = aligned_alloc(64, n);
        b->n = b->p ? n : 0;
    }
    return b->p;
}

static _Thread_local buf_t t_gate, t_up, t_act, t_x, t_even, t_odd;

/* ------------------------------------------------------------------ float matmul over columns */

typedef struct {
    const void *w; /* [K, ldw] weights of dtype wdt */
    long ldw, K;
    int wdt;
    const void *x; /* [rows, ldx]: float32, or bf16 for the vdpbf16ps path */
    long ldx;
    int rows;
    float *out;    /* [rows, ldo] */
    long ldo;
} mm_t;

#ifdef HK_AVX512

static inline __m512 w16(const void *w, long i, int wdt, __mmask16 m) {
    if (wdt == DT_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (wdt == DT_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

static inline __attribute__((always_inline)) void
mk_fma(const int rb, const int wdt, const mm_t *a, long k0, long k1, long c, int r0, int nc,
       int first, int prefetch) {
    const __mmask16 m0 = nc >= 16 ? 0xffff : (__mmask16)((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? 0xffff : nc <= 16 ? 0 : (__mmask16)((1u << (nc - 16)) - 1);
    const float *x = (const float *)a->x + (long)r0 * a->ldx;
    float *out = a->out + (long)r0 * a->ldo + c;
    const int esz = wdt == DT_F32 ? 4 : 2;
    __m512 acc0[RB], acc1[RB];
#pragma GCC unroll 12
    for (int r = 0; r < rb; r++) {
        acc0[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, out + r * a->ldo);
        acc1[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, out + r * a->ldo + 16);
    }
    for (long k = k0; k < k1; k++) {
        long i = k * a->ldw + c;
        if (prefetch) {
            const char *p = (const char *)a->w + (i + PD * NC) * esz;
            _mm_prefetch(p, _MM_HINT_T0);
            if (esz == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        __m512 v0 = w16(a->w, i, wdt, m0), v1 = w16(a->w, i + 16, wdt, m1);
#pragma GCC unroll 12
        for (int r = 0; r < rb; r++) {
            __m512 xv = _mm512_set1_ps(x[r * a->ldx + k]);
            acc0[r] = _mm512_fmadd_ps(v0, xv, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(v1, xv, acc1[r]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rb; r++) {
        _mm512_mask_storeu_ps(out + r * a->ldo, m0, acc0[r]);
        _mm512_mask_storeu_ps(out + r * a->ldo + 16, m1, acc1[r]);
    }
}

#ifdef HK_BF16
/* vdpbf16ps multiplies pairs of adjacent bf16 in a 32-bit lane: two weight rows k, k+1 are
 * interleaved by unpack (within 128-bit lanes, so the accumulators' columns are permuted:
 * acc0 lane 4L+i is column 8L+i, acc1 lane 4L+i column 8L+4+i), against x[k], x[k+1]. */
static inline __attribute__((always_inline)) void
mk_dp(const int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first,
      int prefetch) {
    const __mmask32 m = nc >= 32 ? 0xffffffffu : (__mmask32)((1u << nc) - 1);
    const __mmask16 m0 = (__mmask16)m, m1 = (__mmask16)(m >> 16);
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi_idx = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i n0_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i n1_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const uint16_t *x = (const uint16_t *)a->x + (long)r0 * a->ldx;
    const uint16_t *w = (const uint16_t *)a->w;
    float *out = a->out + (long)r0 * a->ldo + c;
    __m512 acc0[RB], acc1[RB];
#pragma GCC unroll 12
    for (int r = 0; r < rb; r++) {
        if (first) {
            acc0[r] = acc1[r] = _mm512_setzero_ps();
        } else {
            __m512 n0 = _mm512_maskz_loadu_ps(m0, out + r * a->ldo);
            __m512 n1 = _mm512_maskz_loadu_ps(m1, out + r * a->ldo + 16);
            acc0[r] = _mm512_permutex2var_ps(n0, lo_idx, n1);
            acc1[r] = _mm512_permutex2var_ps(n0, hi_idx, n1);
        }
    }
    long k = k0;
    for (; k + 1 < k1; k += 2) {
        long i = k * a->ldw + c;
        if (prefetch) {
            _mm_prefetch((const char *)(w + i + PD * NC), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + i + PD * NC + a->ldw), _MM_HINT_T0);
        }
        __m512i ra = _mm512_maskz_loadu_epi16(m, w + i), rb_ = _mm512_maskz_loadu_epi16(m, w + i + a->ldw);
        __m512bh v0 = (__m512bh)_mm512_unpacklo_epi16(ra, rb_);
        __m512bh v1 = (__m512bh)_mm512_unpackhi_epi16(ra, rb_);
#pragma GCC unroll 12
        for (int r = 0; r < rb; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * a->ldx + k, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], v0, xv);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], v1, xv);
        }
    }
    if (k < k1) { /* an odd last row: its partner is zero, and so is x's */
        __m512i ra = _mm512_maskz_loadu_epi16(m, w + k * a->ldw + c), z = _mm512_setzero_si512();
        __m512bh v0 = (__m512bh)_mm512_unpacklo_epi16(ra, z);
        __m512bh v1 = (__m512bh)_mm512_unpackhi_epi16(ra, z);
#pragma GCC unroll 12
        for (int r = 0; r < rb; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * a->ldx + k]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], v0, xv);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], v1, xv);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rb; r++) {
        _mm512_mask_storeu_ps(out + r * a->ldo, m0, _mm512_permutex2var_ps(acc0[r], n0_idx, acc1[r]));
        _mm512_mask_storeu_ps(out + r * a->ldo + 16, m1, _mm512_permutex2var_ps(acc0[r], n1_idx, acc1[r]));
    }
}
#endif /* HK_BF16 */

#ifdef HK_AMX
/* AMX tiles for many rows (docs/design.md, "Host compute of misses"). With r rows a weight
 * costs r multiply-adds, which outruns vdpbf16ps past a few rows; one tdpbf16ps multiplies a
 * [16, 32] block of x by a [32, 16] block of weights. The weight block is held in pairs of
 * rows (tile row i: weight rows 2i and 2i + 1 interleaved), so each panel's strip of weights
 * is repacked into L1 on its way in; x (its rows padded to 16) and the partial sums are
 * loaded as they lie. Tiles 0-1: x blocks, 2-3: weight blocks, 4-7: sums. */
#define AMX_K 32    /* weight rows one tile multiplies */
#ifndef AMX_KB
#define AMX_KB 32 /* weight rows of a panel: more rows, more streams than the TLB and prefetchers keep up with */
#endif
#ifndef AMX_HINT
#define AMX_HINT _MM_HINT_T1
#endif
#ifndef AMX_PD
#define AMX_PD 2 /* strips ahead that each weight row is prefetched */
#endif
#ifndef AMX_ROWS
#define AMX_ROWS 5 /* rows from which the tiles beat vdpbf16ps */
#endif

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused */

/* Linux gives the tiles' register state only to a process that asks for it. */
static int amx_ready(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return amx_state > 0;
}

/* Per thread: every tile 16 rows of 64 bytes. */
static void amx_config(void) {
    tilecfg_t c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

static const uint16_t amx_lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t amx_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* Weight rows [p0, p1) by columns [c, c + 32) -> per 32 rows two [16, 32] tiles (columns c and
 * c + 16) at buf + 1024 t and + 512. */
static void amx_pack(const uint16_t *w, long ldw, long p0, long p1, long c, uint16_t *buf) {
    const __m512i lo = _mm512_loadu_si512(amx_lo), hi = _mm512_loadu_si512(amx_hi);
    for (long k = p0; k < p1; k += 2) {
        const uint16_t *a = w + k * ldw + c, *b = a + ldw;
        _mm_prefetch((const char *)(a + AMX_PD * NC), AMX_HINT);
        _mm_prefetch((const char *)(b + AMX_PD * NC), AMX_HINT);
        __m512i ra = _mm512_loadu_si512(a), rb = _mm512_loadu_si512(b);
        uint16_t *o = buf + (k - p0) / AMX_K * 1024 + (k - p0) % AMX_K / 2 * 32;
        _mm512_store_si512(o, _mm512_permutex2var_epi16(ra, lo, rb));
        _mm512_store_si512(o + 512, _mm512_permutex2var_epi16(ra, hi, rb));
    }
}

/* Columns [c, c + 32) of weight rows [p0, p1) from the packed tiles at buf: out[:, c:c+32]
 * (over a->rows rows, a multiple of 16) gets x[:, p0:p1] @ those weights, added to what it
 * holds unless first. */
static void amx_strip(const mm_t *a, long p0, long p1, long c, const uint16_t *buf, int first) {
    const uint16_t *x = (const uint16_t *)a->x;
    const long sx = a->ldx * 2, so = a->ldo * 4;
    for (int r0 = 0; r0 < a->rows; r0 += 32) {
        const int two = r0 + 16 < a->rows;
        float *o = a->out + r0 * a->ldo + c, *o2 = o + 16 * a->ldo;
        const uint16_t *x0 = x + r0 * a->ldx, *x1 = x0 + 16 * a->ldx;
        if (first) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
        } else {
            _tile_loadd(4, o, so);
            _tile_loadd(5, o + 16, so);
            if (two) {
                _tile_loadd(6, o2, so);
                _tile_loadd(7, o2 + 16, so);
            }
        }
        for (long k = p0; k < p1; k += AMX_K) {
            const uint16_t *b = buf + (k - p0) / AMX_K * 1024;
            _tile_loadd(2, b, 64);
            _tile_loadd(3, b + 512, 64);
            _tile_loadd(0, x0 + k, sx);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (two) {
                _tile_loadd(1, x1 + k, sx);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, o, so);
        _tile_stored(5, o + 16, so);
        if (two) {
            _tile_stored(6, o2, so);
            _tile_stored(7, o2 + 16, so);
        }
    }
}

/* mm_block on the tiles over one column block: bf16 x and weights, a->rows a multiple of 16,
 * k1 - k0 a multiple of AMX_K, c1 - c0 of NC; the thread's tiles configured (amx_config).
 * Each strip is packed one strip ahead of the tiles that read it, so the tile loads never
 * wait on the packing's stores and the weight reads overlap the multiplies. */
static void amx_columns(const mm_t *a, long k0, long k1, long c0, long c1) {
    static _Thread_local uint16_t pack[2][AMX_KB * NC] __attribute__((aligned(64)));
    for (long p0 = k0; p0 < k1; p0 += AMX_KB) {
        long p1 = p0 + AMX_KB < k1 ? p0 + AMX_KB : k1;
        int i = 0;
        for (long c = c0; c < c1; c += NC, i ^= 1) {
            amx_pack((const uint16_t *)a->w, a->ldw, p0, p1, c, pack[i]);
            if (c > c0) amx_strip(a, p0, p1, c - NC, pack[i ^ 1], p0 == k0);
        }
        amx_strip(a, p0, p1, c1 - NC, pack[i ^ 1], p0 == k0);
    }
}

static void mm_block_amx(const mm_t *a, long k0, long k1, long c0, long c1) {
    /* column blocks whose sums stay in L2 while every panel of weight rows passes over them */
    const long cb = (PART_BYTES / (4L * a->rows)) / NC * NC > NC ? (PART_BYTES / (4L * a->rows)) / NC * NC : NC;
    for (long b0 = c0; b0 < c1; b0 += cb)
        amx_columns(a, k0, k1, b0, b0 + cb < c1 ? b0 + cb : c1);
}
#endif /* HK_AMX */

#define MK_CASES(CALL) \
    switch (rb) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
    case 7: CALL(7); break; case 8: CALL(8); break; case 9: CALL(9); break; \
    case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); break; }

static void mk_fma_bf16(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
#define CALL(R) mk_fma(R, DT_BF16, a, k0, k1, c, r0, nc, first, pf)
    MK_CASES(CALL)
#undef CALL
}
static void mk_fma_f16(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
#define CALL(R) mk_fma(R, DT_F16, a, k0, k1, c, r0, nc, first, pf)
    MK_CASES(CALL)
#undef CALL
}
static void mk_fma_f32(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
#define CALL(R) mk_fma(R, DT_F32, a, k0, k1, c, r0, nc, first, pf)
    MK_CASES(CALL)
#undef CALL
}
#ifdef HK_BF16
static void mk_dp_bf16(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
#define CALL(R) mk_dp(R, a, k0, k1, c, r0, nc, first, pf)
    MK_CASES(CALL)
#undef CALL
}
#endif

#else /* portable */

/* Written for the compiler's vectorizer: the inner loops run over NC columns. */
static inline __attribute__((always_inline)) void
mk_gen(const int wdt, int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first,
       int prefetch) {
    float acc[RB][NC];
    const float *x = (const float *)a->x + (long)r0 * a->ldx;
    float *out = a->out + (long)r0 * a->ldo + c;
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < NC; j++) acc[r][j] = (first || j >= nc) ? 0.0f : out[r * a->ldo + j];
    for (long k = k0; k < k1; k++) {
        float wv[NC];
        long i = k * a->ldw + c;
        if (prefetch)
            __builtin_prefetch((const char *)a->w + (i + PD * NC) * (wdt == DT_F32 ? 4 : 2), 0, 3);
        if (nc == NC) {
            for (int j = 0; j < NC; j++) wv[j] = load_f32(a->w, i + j, wdt);
        } else {
            for (int j = 0; j < NC; j++) wv[j] = j < nc ? load_f32(a->w, i + j, wdt) : 0.0f;
        }
        for (int r = 0; r < rb; r++) {
            float xv = x[r * a->ldx + k];
            for (int j = 0; j < NC; j++) acc[r][j] += xv * wv[j];
        }
    }
    for (int r = 0; r < rb; r++)
        for (int j = 0; j < nc; j++) out[r * a->ldo + j] = acc[r][j];
}

static void mk_gen_bf16(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
    mk_gen(DT_BF16, rb, a, k0, k1, c, r0, nc, first, pf);
}
static void mk_gen_f16(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
    mk_gen(DT_F16, rb, a, k0, k1, c, r0, nc, first, pf);
}
static void mk_gen_f32(int rb, const mm_t *a, long k0, long k1, long c, int r0, int nc, int first, int pf) {
    mk_gen(DT_F32, rb, a, k0, k1, c, r0, nc, first, pf);
}
#endif

typedef void (*mk_fn)(int, const mm_t *, long, long, long, int, int, int, int);

/* out[:, c0:c1] = x[:, k0:k1] @ w[k0:k1, c0:c1]: panels of kb weight rows, each swept in
 * strips of NC columns, so that each thread reads kb rows side by side, each one a long
 * ascending run (the hardware prefetchers follow a few such streams; short runs a matrix row
 * apart they do not); row blocks after the first find the strip in L1. */
static void mm_block(const mm_t *a, mk_fn mk, long k0, long k1, long c0, long c1, long kb) {
    for (long p0 = k0; p0 < k1; p0 += kb) {
        long p1 = p0 + kb < k1 ? p0 + kb : k1;
        for (long c = c0; c < c1; c += NC) {
            int nc = c1 - c < NC ? (int)(c1 - c) : NC;
            /* blocks of equal rows: 16 rows as 8 + 8, not 12 + a weak 4 */
            int blocks = (a->rows + RB - 1) / RB;
            for (int b = 0; b < blocks; b++) {
                int r0 = a->rows * b / blocks, rb = a->rows * (b + 1) / blocks - r0;
                mk(rb, a, p0, p1, c, r0, nc, p0 == k0, b == 0);
            }
        }
    }
}

static mk_fn pick_mk(int wdt, int dp) {
#ifdef HK_AVX512
#ifdef HK_BF16
    if (dp) return mk_dp_bf16;
#endif
    (void)dp;
    return wdt == DT_BF16 ? mk_fma_bf16 : wdt == DT_F16 ? mk_fma_f16 : mk_fma_f32;
#else
    (void)dp;
    return wdt == DT_BF16 ? mk_gen_bf16 : wdt == DT_F16 ? mk_gen_f16 : mk_gen_f32;
#endif
}

static inline int team_rank(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* How a [K, N] product of `rows` rows is cut between nt threads: tk ranges of weight rows by
 * tc ranges of columns, each thread one (range, range) rectangle into partial sums of its own
 * (summed over the tk row ranges afterwards). Rows first, since they keep a thread's weight
 * rows whole; columns only as far as needed to keep a thread's partial sums in its L2.
 * kb: weight rows a panel reads side by side (more rows spend fewer accumulator loads and
 * stores per weight, fewer keep the streams few). */
typedef struct { int tk, tc; long kb; int amx; } grid_t;

/* Row strides of the scratch the tiles read and write: rows of a multiple of 4 KiB apart
 * (4096, 14336 ...) would share one L1 set, so AMX pads them by a cache line. */
static inline long padded(long n, int amx, int esz) { return amx ? n + 64 / esz : n; }

static grid_t plan(long K, long N, int rows, int nt, int amx) {
    grid_t g;
    g.amx = amx;
    long fit = PART_BYTES / (4L * rows), units = (N + NC - 1) / NC;
    int need = 1;
    while (need < nt && (units + need - 1) / need * NC > fit) need++;
    g.tc = nt;
    for (int tc = need; tc <= nt; tc++)
        if (nt % tc == 0) { g.tc = tc; break; }
    g.tk = nt / g.tc;
    const long unit = amx ? 32 : 16; /* at least this many weight rows a range */
    long most = (K + unit - 1) / unit;
    if (g.tk > most) g.tk = (int)most;
    g.kb = rows <= 4 ? 8 : rows <= 12 ? 16 : rows <= 32 ? 64 : 128;
    return g;
}

/* [lo, hi) of range i of n ranges over len, in whole units. */
static void range(long len, long unit, int i, int n, long *lo, long *hi) {
    long units = (len + unit - 1) / unit;
    *lo = units * i / n * unit;
    *hi = units * (i + 1) / n * unit;
    if (*lo > len) *lo = len;
    if (*hi > len) *hi = len;
}

/* This thread's rectangle of a product on grid g: its partial sums go to part + tk * rows * N. */
static void product(const mm_t *a, mk_fn mk, grid_t g, int t, float *part) {
    const long ldp = padded(a->ldw, g.amx, 4);
    if (t >= g.tk * g.tc) return;
    int tk = t / g.tc, tc = t % g.tc;
    long k0, k1, c0, c1;
    range(a->K, g.amx ? 32 : 16, tk, g.tk, &k0, &k1);
    range(a->ldw, NC, tc, g.tc, &c0, &c1);
    if (k0 >= k1 || c0 >= c1) return;
    mm_t mine = *a;
    mine.out = part + (long)tk * a->rows * ldp;
    mine.ldo = ldp;
#ifdef HK_AMX
    if (g.amx) {
        mm_block_amx(&mine, k0, k1, c0, c1);
        return;
    }
#endif
    mm_block(&mine, mk, k0, k1, c0, c1, g.kb);
}

#define CHUNK 256

/* act[:, c0:c1] = silu(gate) * up rounded to xdt, gate and up summed over tk partials [tk,
 * rows, ldp]; written as float32 (the rounded value) or, for the vdpbf16ps path, as bf16, in
 * rows lda apart. */
static void activate(const float *pg, const float *pu, int tk, int rows, long ldp, long lda,
                     long c0, long c1, int xdt, int act_bf16, void *act) {
    const long stride = (long)rows * ldp;
    float g[CHUNK], u[CHUNK];
    for (int r = 0; r < rows; r++) {
        for (long cc = c0; cc < c1; cc += CHUNK) {
            int n = c1 - cc < CHUNK ? (int)(c1 - cc) : CHUNK;
            const long base = r * ldp + cc, at = r * lda + cc;
            for (int j = 0; j < n; j++) {
                g[j] = pg[base + j];
                u[j] = pu[base + j];
            }
            for (int t = 1; t < tk; t++)
                for (int j = 0; j < n; j++) {
                    g[j] += pg[t * stride + base + j];
                    u[j] += pu[t * stride + base + j];
                }
            if (act_bf16) {
                uint16_t *o = (uint16_t *)act + at;
                for (int j = 0; j < n; j++) o[j] = f32_bf16(g[j] / (1.0f + hk_exp(-g[j])) * u[j]);
            } else if (xdt == DT_BF16) {
                float *o = (float *)act + at;
                for (int j = 0; j < n; j++) o[j] = bf16_f32(f32_bf16(g[j] / (1.0f + hk_exp(-g[j])) * u[j]));
            } else {
                float *o = (float *)act + at;
                for (int j = 0; j < n; j++) {
                    float v = g[j] / (1.0f + hk_exp(-g[j])) * u[j];
                    o[j] = xdt == DT_F16 ? f16_f32(f32_f16(v)) : v;
                }
            }
        }
    }
}

/* out[:, c0:c1] = the sum of tk partials [tk, >= rows, ldp] (stride floats apart). */
static void reduce(const float *part, int tk, int rows, long stride, long ldp, long n, long c0,
                   long c1, float *out) {
    for (int r = 0; r < rows; r++) {
        float *o = out + r * n;
        const float *p = part + r * ldp;
        for (long c = c0; c < c1; c++) o[c] = p[c];
        for (int t = 1; t < tk; t++)
            for (long c = c0; c < c1; c++) o[c] += p[t * stride + c];
    }
}

/* ------------------------------------------------------------------ entry points */

const char *strata_isa(void) {
#if defined(HK_AMX)
    return amx_ready() ? "avx512bf16-amx" : "avx512bf16";
#elif defined(HK_BF16)
    return "avx512bf16";
#elif defined(HK_AVX512)
    return "avx512";
#else
    return "portable";
#endif
}

int strata_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* One float expert: w1, w3 [d, f], w2 [f, d] of dtype wdt; x [rows, d] of dtype xdt; out
 * [rows, d] float32. Returns 0, or -1 if a scratch buffer could not be allocated. */
int strata_swiglu(const void *w1, const void *w3, const void *w2, int wdt, const void *x, int xdt,
                  int rows, long d, long f, float *out, int threads) {
    if (rows <= 0) return 0;
    const int nt = threads > 0 ? threads : 1;
    int dp = 0, amx = 0;
#ifdef HK_BF16
    dp = wdt == DT_BF16 && xdt == DT_BF16;
#endif
#ifdef HK_AMX
    amx = dp && rows >= AMX_ROWS && d % 32 == 0 && f % 32 == 0 && amx_ready();
#endif
    /* the tiles take x in blocks of 16 rows: the padding rows are zeros, their sums dropped */
    const int R = amx ? (rows + 15) & ~15 : rows;
    grid_t gu = plan(d, f, R, nt, amx), gd = plan(f, d, R, nt, amx);
    const int direct = !amx && gd.tk == 1; /* the down projection writes out itself */
    const long lu = padded(f, amx, 4), ld = padded(d, amx, 4), lx = padded(d, amx, 2),
               la = padded(f, amx, 2);
    float *pg = grow(&t_gate, sizeof(float) * gu.tk * R * lu);
    float *pu = grow(&t_up, sizeof(float) * gu.tk * R * lu);
    float *pd = direct ? out : grow(&t_even, sizeof(float) * gd.tk * R * ld);
    void *act = grow(&t_act, (dp ? 2 : 4) * (size_t)R * la);
    const void *xin = x;
    if (!pg || !pu || !pd || !act) return -1;
    if (amx) { /* rows padded to R, each row padded to lx */
        uint16_t *xp = grow(&t_x, sizeof(uint16_t) * R * lx);
        if (!xp) return -1;
        memset(xp, 0, sizeof(uint16_t) * R * lx);
        for (int r = 0; r < rows; r++) memcpy(xp + r * lx, (const uint16_t *)x + r * d, 2 * d);
        xin = xp;
    } else if (!dp && xdt != DT_F32) {
        float *xf = grow(&t_x, sizeof(float) * rows * d);
        if (!xf) return -1;
        for (long i = 0; i < rows * d; i++) xf[i] = load_f32(x, i, xdt);
        xin = xf;
    }
    mk_fn mk = pick_mk(wdt, dp);
    mm_t g = {w1, f, d, wdt, xin, lx, R, NULL, 0};
    mm_t u = {w3, f, d, wdt, xin, lx, R, NULL, 0};
    mm_t o = {w2, d, f, wdt, act, la, R, NULL, 0};
#pragma omp parallel num_threads(nt)
    {
        int t = team_rank(), team = team_size();
        long lo, hi;
#ifdef HK_AMX
        if (amx) amx_config();
#endif
        if (team != nt) { /* a smaller team than asked (nested or limited): one thread works */
            if (t == 0) {
                grid_t one = {1, 1, gu.kb, amx};
                product(&g, mk, one, 0, pg);
                product(&u, mk, one, 0, pu);
                activate(pg, pu, 1, R, lu, la, 0, f, xdt, dp, act);
                one.kb = gd.kb;
                product(&o, mk, one, 0, pd);
                if (!direct) reduce(pd, 1, rows, R * ld, ld, d, 0, d, out);
            }
        } else {
            product(&g, mk, gu, t, pg);
            product(&u, mk, gu, t, pu);
#pragma omp barrier
            range(f, NC, t, nt, &lo, &hi);
            if (lo < hi) activate(pg, pu, gu.tk, R, lu, la, lo, hi, xdt, dp, act);
#pragma omp barrier
            product(&o, mk, gd, t, pd);
            if (!direct) {
#pragma omp barrier
                range(d, NC, t, nt, &lo, &hi);
                if (lo < hi) reduce(pd, gd.tk, rows, R * ld, ld, d, lo, hi, out);
            }
        }
#ifdef HK_AMX
        if (amx) _tile_release();
#endif
    }
    return 0;
}

/* ------------------------------------------------------------------ packed int4 */

/* Packed int4 weight [n, k] (k inputs, n outputs): bytes output-major, byte (o, i) holding
 * inputs 2i (low nibble) and 2i + 1 (high) as two's complement, in tiles of tr outputs by tb
 * inputs stored contiguously ([n/tr, k/tb, tr, tb/2]; row-major is tr = 1, tb = k); scales
 * bf16 [k/group, n]. */
typedef struct {
    const uint8_t *p;
    const uint16_t *s;
    long n, k, tr, tb, group;
} q4_t;

/* The bytes of inputs [i0, i0 + 32) of output o (i0 a multiple of 32): contiguous. */
static inline const uint8_t *q4_at(const q4_t *w, long o, long i0) {
    return w->p + ((o / w->tr) * (w->k / w->tb) + i0 / w->tb) * (w->tr * w->tb / 2)
           + (o % w->tr) * (w->tb / 2) + (i0 % w->tb) / 2;
}

#define Q4C 4  /* output columns at a time */
#define Q4R 4  /* rows at a time */

/* out[r, o] for o in [c0, c1): xe/xo [rows, k/2] float32, x's even and odd inputs. */
static void q4_cols(const q4_t *w, const float *xe, const float *xo, int rows, float *out,
                    long ldo, long c0, long c1) {
    const long half = w->k / 2;
#ifdef HK_AVX512
    const __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    for (long o0 = c0; o0 < c1; o0 += Q4C) {
        int nc = c1 - o0 < Q4C ? (int)(c1 - o0) : Q4C;
        for (int r0 = 0; r0 < rows; r0 += Q4R) {
            int nr = rows - r0 < Q4R ? rows - r0 : Q4R;
            __m512 acc[Q4R][Q4C];
            for (int r = 0; r < Q4R; r++)
                for (int j = 0; j < Q4C; j++) acc[r][j] = _mm512_setzero_ps();
            __m512 table[Q4C] = {_mm512_setzero_ps()};
            for (long i0 = 0; i0 < w->k; i0 += 32) {
                if (i0 % w->group == 0) {
                    for (int j = 0; j < Q4C; j++) {
                        long oj = o0 + (j < nc ? j : 0);
                        float s = bf16_f32(w->s[(i0 / w->group) * w->n + oj]);
                        table[j] = _mm512_mul_ps(base, _mm512_set1_ps(s));
                    }
                }
                __m512 lo[Q4C], hi[Q4C];
#pragma GCC unroll 4
                for (int j = 0; j < Q4C; j++) {
                    long oj = o0 + (j < nc ? j : 0);
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q4_at(w, oj, i0)));
                    lo[j] = _mm512_permutexvar_ps(v, table[j]);
                    hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[j]);
                }
#pragma GCC unroll 4
                for (int r = 0; r < Q4R; r++) {
                    if (r >= nr) break;
                    __m512 e = _mm512_loadu_ps(xe + (r0 + r) * half + i0 / 2);
                    __m512 od = _mm512_loadu_ps(xo + (r0 + r) * half + i0 / 2);
#pragma GCC unroll 4
                    for (int j = 0; j < Q4C; j++)
                        acc[r][j] = _mm512_fmadd_ps(hi[j], od, _mm512_fmadd_ps(lo[j], e, acc[r][j]));
                }
            }
            for (int r = 0; r < nr; r++)
                for (int j = 0; j < nc; j++) out[(r0 + r) * ldo + o0 + j] = _mm512_reduce_add_ps(acc[r][j]);
        }
    }
#else
    for (long o0 = c0; o0 < c1; o0++) {
        for (int r0 = 0; r0 < rows; r0 += Q4R) {
            int nr = rows - r0 < Q4R ? rows - r0 : Q4R;
            float acc[Q4R][16] = {{0}};
            float table[16] = {0};
            for (long i0 = 0; i0 < w->k; i0 += 32) {
                if (i0 % w->group == 0) {
                    float s = bf16_f32(w->s[(i0 / w->group) * w->n + o0]);
                    for (int q = 0; q < 16; q++) table[q] = (float)(q < 8 ? q : q - 16) * s;
                }
                const uint8_t *b = q4_at(w, o0, i0);
                float lo[16], hi[16];
                for (int j = 0; j < 16; j++) {
                    lo[j] = table[b[j] & 15];
                    hi[j] = table[b[j] >> 4];
                }
                for (int r = 0; r < nr; r++) {
                    const float *e = xe + (r0 + r) * half + i0 / 2, *od = xo + (r0 + r) * half + i0 / 2;
                    for (int j = 0; j < 16; j++) acc[r][j] += lo[j] * e[j] + hi[j] * od[j];
                }
            }
            for (int r = 0; r < nr; r++) {
                float sum = 0.0f;
                for (int j = 0; j < 16; j++) sum += acc[r][j];
                out[(r0 + r) * ldo + o0] = sum;
            }
        }
    }
#endif
}

#ifdef HK_BF16
#define Q4DR 6 /* rows at a time, vdpbf16ps path */

/* q4_cols for bf16 rows xb [rows, k]: a nibble pair becomes two bf16 weights in one 32-bit
 * lane by one vpermw of the group's table (q * s rounded to bf16, as the device dequantizes),
 * against x's pair of the same inputs. */
static void q4_cols_dp(const q4_t *w, const uint16_t *xb, int rows, float *out, long ldo,
                       long c0, long c1) {
    const __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    for (long o0 = c0; o0 < c1; o0 += Q4C) {
        int nc = c1 - o0 < Q4C ? (int)(c1 - o0) : Q4C;
        for (int r0 = 0; r0 < rows; r0 += Q4DR) {
            int nr = rows - r0 < Q4DR ? rows - r0 : Q4DR;
            __m512 acc[Q4DR][Q4C];
            for (int r = 0; r < Q4DR; r++)
                for (int j = 0; j < Q4C; j++) acc[r][j] = _mm512_setzero_ps();
            __m512i table[Q4C] = {_mm512_setzero_si512()};
            for (long i0 = 0; i0 < w->k; i0 += 32) {
                if (i0 % w->group == 0) {
                    for (int j = 0; j < Q4C; j++) {
                        long oj = o0 + (j < nc ? j : 0);
                        float s = bf16_f32(w->s[(i0 / w->group) * w->n + oj]);
                        __m256i t16 = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(base, _mm512_set1_ps(s)));
                        table[j] = _mm512_broadcast_i64x4(t16);
                    }
                }
                __m512bh wv[Q4C];
#pragma GCC unroll 4
                for (int j = 0; j < Q4C; j++) {
                    long oj = o0 + (j < nc ? j : 0);
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q4_at(w, oj, i0)));
                    __m512i idx = _mm512_or_si512(v, _mm512_slli_epi32(v, 12));
                    wv[j] = (__m512bh)_mm512_permutexvar_epi16(idx, table[j]);
                }
#pragma GCC unroll 6
                for (int r = 0; r < Q4DR; r++) {
                    if (r >= nr) break;
                    __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (long)(r0 + r) * w->k + i0);
#pragma GCC unroll 4
                    for (int j = 0; j < Q4C; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
                }
            }
            for (int r = 0; r < nr; r++)
                for (int j = 0; j < nc; j++) out[(r0 + r) * ldo + o0 + j] = _mm512_reduce_add_ps(acc[r][j]);
        }
    }
}
#endif

/* x [rows, k] float32 -> its even and odd inputs [rows, k/2]. */
static void deinterleave(const float *x, int rows, long k, float *xe, float *xo) {
    for (long i = 0; i < rows * k / 2; i++) {
        xe[i] = x[2 * i];
        xo[i] = x[2 * i + 1];
    }
}

/* One packed int4 expert: w1, w3 [d inputs, f outputs], w2 [f inputs, d outputs] (q4_t), tile
 * (tr, tb) shared by the three; x [rows, d] of dtype xdt; out [rows, d] float32. The inputs d
 * and f must be multiples of 32 and of the tile, the group a multiple of 32. */
int strata_swiglu_int4(const uint8_t *p1, const uint16_t *s1, const uint8_t *p3,
                       const uint16_t *s3, const uint8_t *p2, const uint16_t *s2, long tr1,
                       long tb1, long tr2, long tb2, long group, const void *x, int xdt,
                       int rows, long d, long f, float *out, int threads) {
    if (rows <= 0) return 0;
    if (d % 32 || f % 32 || group % 32 || tb1 % 32 || tb2 % 32 || d % tb1 || f % tb2 ||
        f % tr1 || d % tr2)
        return -2;
    float *gate = grow(&t_gate, sizeof(float) * rows * f), *up = grow(&t_up, sizeof(float) * rows * f);
    q4_t g = {p1, s1, f, d, tr1, tb1, group}, u = {p3, s3, f, d, tr1, tb1, group};
    q4_t o = {p2, s2, d, f, tr2, tb2, group};
    const int nt_want = threads > 0 ? threads : 1;
    (void)nt_want; /* unused without OpenMP */
    if (!gate || !up) return -1;
#ifdef HK_BF16
    /* With few rows the dequantization is the work, and the float32 table costs less. */
    if (xdt == DT_BF16 && rows > 4) {
        uint16_t *act = grow(&t_act, sizeof(uint16_t) * rows * f);
        if (!act) return -1;
        const uint16_t *xb = (const uint16_t *)x;
#pragma omp parallel num_threads(nt_want)
        {
            int t = team_rank(), nt = team_size();
            long lo, hi;
            range(f, Q4C, t, nt, &lo, &hi);
            if (lo < hi) {
                q4_cols_dp(&g, xb, rows, gate, f, lo, hi);
                q4_cols_dp(&u, xb, rows, up, f, lo, hi);
                activate(gate, up, 1, rows, f, f, lo, hi, xdt, 1, act);
            }
#pragma omp barrier
            range(d, Q4C, t, nt, &lo, &hi);
            if (lo < hi) q4_cols_dp(&o, act, rows, out, d, lo, hi);
        }
        return 0;
    }
#endif
    float *act = grow(&t_act, sizeof(float) * rows * f);
    float *xf = grow(&t_x, sizeof(float) * rows * d);
    long big = d > f ? d : f;
    float *xe = grow(&t_even, sizeof(float) * rows * big / 2), *xo = grow(&t_odd, sizeof(float) * rows * big / 2);
    if (!act || !xf || !xe || !xo) return -1;
    for (long i = 0; i < rows * d; i++) xf[i] = load_f32(x, i, xdt);
    deinterleave(xf, rows, d, xe, xo);
#pragma omp parallel num_threads(nt_want)
    {
        int t = team_rank(), nt = team_size();
        long lo, hi;
        range(f, Q4C, t, nt, &lo, &hi);
        if (lo < hi) {
            q4_cols(&g, xe, xo, rows, gate, f, lo, hi);
            q4_cols(&u, xe, xo, rows, up, f, lo, hi);
            activate(gate, up, 1, rows, f, f, lo, hi, xdt, 0, act);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long i = 0; i < rows * f / 2; i++) {
            xe[i] = act[2 * i];
            xo[i] = act[2 * i + 1];
        }
        range(d, Q4C, t, nt, &lo, &hi);
        if (lo < hi) q4_cols(&o, xe, xo, rows, out, d, lo, hi);
    }
    return 0;
}
