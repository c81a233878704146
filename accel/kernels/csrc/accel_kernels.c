/* accel CPU kernels: fused decode + matrix-vector products over accel's stored weight layouts.
 *
 * Every kernel reads the stored bytes as the format library wrote them (docs/format.md) and never builds the
 * dense weight matrix; rows are split between OpenMP threads. Accumulation is float32. Each kernel has an
 * AVX-512 path (used when compiled with -march=native on a CPU that has AVX-512 F/BW/VL), the row kernels also an
 * AVX2 path (AVX2 + FMA + F16C, without AVX-512), and a portable scalar path; accel_set_simd(0) forces the scalar
 * path so both can be tested on one machine.
 *
 * Layouts (n = number of codes, rows x cols, row-major):
 *   affine packed : bit stream, code i at bits [i*b, (i+1)*b), b = 1..8
 *   affine base   : groups of g codes, group value sum q_j L^j stored at B bits in a bit stream
 *   leech planes  : per stage, `bits` planes of 3*nblk bytes (bit 24k+i = bit j of v = (x - p_k)/2 of block k,
 *                   coordinate i, two's complement), then nblk parity bits
 *   leech onehot  : per stage, K magnitude masks (|x| = 2k + p), a sign plane, each 3*nblk bytes, then parity
 * All functions return 0, or a negative number for arguments they refuse.
 */
#include <float.h>
#include <math.h>
#include "omp_compat.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* AVX2 + FMA + F16C without AVX-512 (Zen 1-3, Intel client cores; -march=x86-64-v3 on any newer x86): 8-lane
 * versions of the row kernels (affine packed and base-L, Leech planes and onehot in 8-row tiles, the transforms)
 * and of the 4- and 2-bit affine tiles (vpmaddubsw); the other integer tile kernels are AVX-512 only, so their
 * serving copies are not made there (accel_tiled_kinds). */
#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#define SIMD_BITS (HAVE_AVX512 ? 512 : (HAVE_AVX2 ? 256 : 0))

#if HAVE_AVX512 && defined(__AVX512VNNI__)
#define HAVE_VNNI 1 /* the integer tile kernels (affine tiles; Leech tiles also need GFNI) */
#else
#define HAVE_VNNI 0
#endif

#define API __attribute__((visibility("default")))
#define AI static inline __attribute__((always_inline))

static int g_simd = SIMD_BITS > 0;

/* the vector width of the SIMD paths compiled in: 512 (AVX-512), 256 (AVX2), 0 (scalar only) */
API int accel_simd_available(void) { return SIMD_BITS; }

/* 1 when built with OpenMP (the kernels split rows between threads), 0 when the compiler had none (one thread) */
API int accel_openmp_available(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

API float accel_half_to_float(uint16_t h);

API int accel_set_simd(int on) {
    g_simd = on && SIMD_BITS > 0;
    return g_simd;
}

/* How the VNNI tiles take 2-bit fields 1..3 out of a code byte: 0 one gf2p8affineqb, 1 a shift and an AND. Zen 4
 * (AMD family 25 with AVX-512) runs gf2p8affineqb, like vpcmpub, on the one pipe that also runs its 512-bit
 * vpdpbusd (one a cycle), and its shifts beside it, so there the shift is faster (int2 4096x4096, one thread, in
 * cache, the two alternated in one process: 298-301 -> 270-272 us); on the host where gf2p8affineqb was chosen (2026-12-03) it made int2 1.1x faster. GCC 12's
 * -march=native does not tell Zen 4 from Zen 3 (both znver3), so the CPU is asked at load. */
static int g_fields_by_shift;
__attribute__((constructor)) static void fields_by_shift_init(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    const int amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    const unsigned family = ((a >> 8) & 0xf) == 0xf ? 0xf + ((a >> 20) & 0xff) : (a >> 8) & 0xf;
    g_fields_by_shift = amd && family == 25 && HAVE_AVX512;
#endif
}

/* the field extraction in use (see g_fields_by_shift); mode 0 or 1 sets it (the tests run both), -1 only reads */
API int accel_fields_by_shift(int mode) {
    if (mode == 0 || mode == 1) g_fields_by_shift = mode;
    return g_fields_by_shift;
}

/* ------------------------------------------------------------------------------------------------ helpers */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

API float accel_half_to_float(uint16_t h) { return half_to_float(h); }

/* scale/offset arrays are float16 (is_f32 = 0) or float32 */
static inline float side_value(const void *p, int is_f32, int64_t i) {
    return is_f32 ? ((const float *)p)[i] : half_to_float(((const uint16_t *)p)[i]);
}

static int threads_for(int requested, double work) {
    int n = requested > 0 ? requested : omp_get_max_threads();
    if (work < 65536.0) n = 1; /* a fork costs more than the work */
    return n < 1 ? 1 : n;
}

static void *xalloc(size_t bytes) {
    size_t size = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, size ? size : 64);
}

/* code i (width `bits` <= 8) of a little-endian bit stream; reads only bytes that hold its bits */
static inline unsigned get_code(const uint8_t *p, uint64_t bitpos, int bits) {
    uint64_t byte = bitpos >> 3;
    unsigned sh = (unsigned)(bitpos & 7);
    unsigned v = p[byte];
    if (sh + (unsigned)bits > 8) v |= (unsigned)p[byte + 1] << 8;
    return (v >> sh) & ((1u << bits) - 1u);
}

/* `nbits` <= 57 bits of a stream of `nbytes` bytes starting at bit `bitpos`, without reading past the end */
static inline uint64_t get_bits(const uint8_t *p, int64_t nbytes, uint64_t bitpos, int nbits) {
    uint64_t byte = bitpos >> 3, word = 0;
    int64_t avail = nbytes - (int64_t)byte;
    if (avail >= 8) {
        memcpy(&word, p + byte, 8);
    } else {
        memcpy(&word, p + byte, (size_t)(avail > 0 ? avail : 0));
    }
    word >>= (bitpos & 7);
    return nbits >= 64 ? word : word & ((1ull << nbits) - 1ull);
}

/* group value of width B <= 64 at bit `bitpos` */
static inline uint64_t get_wide(const uint8_t *p, int64_t nbytes, uint64_t bitpos, int B) {
    if (B <= 57) return get_bits(p, nbytes, bitpos, B);
    uint64_t lo = get_bits(p, nbytes, bitpos, 32);
    uint64_t hi = get_bits(p, nbytes, bitpos + 32, B - 32);
    return lo | (hi << 32);
}

#if HAVE_AVX512
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if HAVE_AVX512 /* one vector of floats, for code written once for both widths */
typedef __m512 vf;
#define VW 16
#define vf_zero _mm512_setzero_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_fma _mm512_fmadd_ps
#elif HAVE_AVX2
typedef __m256 vf;
#define VW 8
#define vf_zero _mm256_setzero_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_fma _mm256_fmadd_ps
#endif
#if HAVE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* *acc += the 16-bit pair sums of q's unsigned bytes times x's signed bytes. In assembly, as dpbusd_bcast: GCC
 * otherwise reassociates the adds into trees of products that outlive the 16 registers (int2: 1000 spill moves) */
AI void maddubs_add(__m256i *acc, __m256i q, __m256i x) {
    __m256i t;
    __asm__("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" : "+x"(*acc), "=&x"(t) : "x"(q), "x"(x));
}

/* lanes i < n all ones (AVX2's masked loads and gathers read the top bit of a lane) */
static inline __m256i lanes8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

/* ------------------------------------------------------------------------------------ fast Hadamard / RHT */

/* the unnormalised Walsh-Hadamard transform of each of the m rows (length P, a power of two) of v */
static void fwht_rows_scalar(float *v, int64_t m, int64_t P) {
    for (int64_t r = 0; r < m; r++) {
        float *row = v + r * P;
        for (int64_t h = 1; h < P; h *= 2)
            for (int64_t i = 0; i < P; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float x = row[j], y = row[j + h];
                    row[j] = x + y;
                    row[j + h] = x - y;
                }
    }
}

#if HAVE_AVX512
/* the stages h = 1, 2, 4 and (full) 8 inside one vector of 16 floats: lanes l and l ^ h exchange, the lane with bit
 * h set keeps the difference */
static inline __attribute__((always_inline)) __m512 wht16(__m512 x, int full) {
    __m512 sw = _mm512_permute_ps(x, 0xB1);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, sw), 0xAAAA, sw, x);
    sw = _mm512_permute_ps(x, 0x4E);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, sw), 0xCCCC, sw, x);
    sw = _mm512_shuffle_f32x4(x, x, 0xB1);
    x = _mm512_mask_sub_ps(_mm512_add_ps(x, sw), 0xF0F0, sw, x);
    if (full) {
        sw = _mm512_shuffle_f32x4(x, x, 0x4E);
        x = _mm512_mask_sub_ps(_mm512_add_ps(x, sw), 0xFF00, sw, x);
    }
    return x;
}

/* as fwht_rows_scalar for P >= 8, the same sums: the first four stages (three for P = 8, two rows a vector) inside
 * vectors, then butterflies of whole vectors (signs and transform of a 4104 = 513 x 8 input: 10.5 -> 4.2 us in the
 * matvec; the 4096-point output transform 10.7 -> 5.3) */
static void fwht_rows(float *v, int64_t m, int64_t P) {
    if (P == 8) {
        for (int64_t i = 0; i < m * 8; i += 16) {
            const __mmask16 k = m * 8 - i >= 16 ? (__mmask16)0xffff : (__mmask16)0x00ff;
            _mm512_mask_storeu_ps(v + i, k, wht16(_mm512_maskz_loadu_ps(k, v + i), 0));
        }
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        float *row = v + r * P;
        for (int64_t i = 0; i < P; i += 16) _mm512_storeu_ps(row + i, wht16(_mm512_loadu_ps(row + i), 1));
        for (int64_t h = 16; h < P; h *= 2)
            for (int64_t i = 0; i < P; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 16) {
                    const __m512 x = _mm512_loadu_ps(row + j), y = _mm512_loadu_ps(row + j + h);
                    _mm512_storeu_ps(row + j, _mm512_add_ps(x, y));
                    _mm512_storeu_ps(row + j + h, _mm512_sub_ps(x, y));
                }
    }
}
#elif HAVE_AVX2
/* the AVX2 fwht_rows for P >= 8: stages h = 1, 2, 4 inside a vector of 8 floats (the lane with bit h set keeps the
 * difference, as in the AVX-512 wht16), then butterflies of whole vectors; the same sums as fwht_rows_scalar */
static void fwht_rows(float *v, int64_t m, int64_t P) {
    for (int64_t r = 0; r < m; r++) {
        float *row = v + r * P;
        for (int64_t i = 0; i < P; i += 8) {
            __m256 x = _mm256_loadu_ps(row + i), sw = _mm256_permute_ps(x, 0xB1);
            x = _mm256_blend_ps(_mm256_add_ps(x, sw), _mm256_sub_ps(sw, x), 0xAA);
            sw = _mm256_permute_ps(x, 0x4E);
            x = _mm256_blend_ps(_mm256_add_ps(x, sw), _mm256_sub_ps(sw, x), 0xCC);
            sw = _mm256_permute2f128_ps(x, x, 0x01);
            _mm256_storeu_ps(row + i, _mm256_blend_ps(_mm256_add_ps(x, sw), _mm256_sub_ps(sw, x), 0xF0));
        }
        for (int64_t h = 8; h < P; h *= 2)
            for (int64_t i = 0; i < P; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 8) {
                    const __m256 x = _mm256_loadu_ps(row + j), y = _mm256_loadu_ps(row + j + h);
                    _mm256_storeu_ps(row + j, _mm256_add_ps(x, y));
                    _mm256_storeu_ps(row + j + h, _mm256_sub_ps(x, y));
                }
    }
}
#endif

static int g_rht_threads = 1; /* threads of a single transform's rotation (set by the fused matvec) */

static void thread_range(int64_t n, int64_t *t0, int64_t *t1);
#if HAVE_AVX512
/* rotate for P = 8 (as for 4104 = 8 * 513 columns), where a vector of P floats would leave half its lanes idle: src
 * is transposed once (8 x m, in L1), then each output element is a dot product of a matrix row with a transposed
 * column, 16 columns a load, two rows at a time (16 independent sums). The matrix is the traffic (1 MB for m = 513):
 * a thread takes the two halves of its rows in turn, two memory streams. */
static void rotate_narrow(const float *mat, int64_t m, const float *src, float *dst) {
    const int64_t m16 = (m + 15) / 16 * 16;
    float *st = xalloc((size_t)(8 * m16) * sizeof(float));
    memset(st, 0, (size_t)(8 * m16) * sizeof(float));
    for (int64_t j = 0; j < m; j++)
        for (int64_t p = 0; p < 8; p++) st[p * m16 + j] = src[j * 8 + p];
    int nt = threads_for(g_rht_threads, (double)m * m * 8);
#pragma omp parallel num_threads(nt)
    {
        int64_t b0, b1;
        thread_range((m + 1) / 2, &b0, &b1);
        const int64_t half = (b1 - b0 + 1) / 2;
        for (int64_t n = 0; n < b1 - b0; n++) {
            const int64_t i0 = 2 * (b0 + (n % 2 ? half + n / 2 : n / 2)), i1 = i0 + 1 < m ? i0 + 1 : i0;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int q = 0; q < 16; q++) acc[q] = _mm512_setzero_ps();
            for (int64_t j = 0; j < m16; j += 16) {
                const __mmask16 km = m - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (m - j)) - 1u);
                _mm_prefetch((const char *)(mat + i0 * m + j + 1024), _MM_HINT_T0);
                _mm_prefetch((const char *)(mat + i1 * m + j + 1024), _MM_HINT_T0);
                const __m512 a = _mm512_maskz_loadu_ps(km, mat + i0 * m + j);
                const __m512 b = _mm512_maskz_loadu_ps(km, mat + i1 * m + j);
#pragma GCC unroll 8
                for (int p = 0; p < 8; p++) {
                    const __m512 sv = _mm512_load_ps(st + p * m16 + j);
                    acc[p] = _mm512_fmadd_ps(a, sv, acc[p]);
                    acc[8 + p] = _mm512_fmadd_ps(b, sv, acc[8 + p]);
                }
            }
            float sums[16];
#pragma GCC unroll 16
            for (int q = 0; q < 16; q++) sums[q] = hsum(acc[q]); /* every accumulator: no dynamic index */
            for (int p = 0; p < 8; p++) dst[i0 * 8 + p] = sums[p];
            if (i1 != i0)
                for (int p = 0; p < 8; p++) dst[i1 * 8 + p] = sums[8 + p];
        }
    }
    free(st);
}
#endif

/* dst (m x P) = mat (m x m) . src (m x P). P = 8: rotate_narrow. P a multiple of 16: eight output rows at a time,
 * so eight independent FMA chains share each load of src (src stays in L1 or L2; the matrix streams as 8 rows) */
static void rotate(const float *mat, int64_t m, int64_t P, const float *src, float *dst) {
#if HAVE_AVX512
    if (g_simd && P == 8) {
        rotate_narrow(mat, m, src, dst);
        return;
    }
#endif
#if HAVE_AVX512 || HAVE_AVX2
    if (g_simd && P % VW == 0) { /* AVX2: P = 8 included (one vector of src a row) */
        int nt = threads_for(g_rht_threads, (double)m * m * P);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t ib = 0; ib < (m + 7) / 8; ib++) {
            const int64_t i0 = ib * 8;
            const float *r[8];
            for (int q = 0; q < 8; q++) r[q] = mat + (i0 + q < m ? i0 + q : m - 1) * m;
            for (int64_t k = 0; k < P; k += VW) {
                vf acc[8];
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) acc[q] = vf_zero();
                for (int64_t j = 0; j < m; j++) {
                    if (!(j & 15) && k == 0) /* each row's line 1 KB ahead, and the next 8 rows' lines into L2 */
                        for (int q = 0; q < 8; q++) {
                            _mm_prefetch((const char *)(r[q] + j + 256), _MM_HINT_T0);
                            _mm_prefetch((const char *)(r[q] + 8 * m + j), _MM_HINT_T2);
                        }
                    const vf v = vf_load(src + j * P + k);
#pragma GCC unroll 8
                    for (int q = 0; q < 8; q++) acc[q] = vf_fma(vf_set1(r[q][j]), v, acc[q]);
                }
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++)
                    if (i0 + q < m) vf_store(dst + (i0 + q) * P + k, acc[q]);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < m; i++) {
        float *d = dst + i * P;
        for (int64_t k = 0; k < P; k++) d[k] = 0.0f;
        for (int64_t j = 0; j < m; j++) {
            const float r = mat[i * m + j], *s = src + j * P;
            for (int64_t k = 0; k < P; k++) d[k] = fmaf(r, s[k], d[k]);
        }
    }
}

/* v <- (mat (x) I_P) v, in place */
static void mix(float *v, int64_t n, const float *mat, int64_t m, float *tmp) {
    if (m > 1) {
        rotate(mat, m, n / m, v, tmp);
        memcpy(v, tmp, (size_t)n * sizeof(float));
    } else if (mat[0] != 1.0f) {
        for (int64_t i = 0; i < n; i++) v[i] *= mat[0];
    }
}

/* Q v (forward: mat = R_m) or Q^T v (inverse: mat = R_m^T, contiguous) for Q = (R_m (x) H_P / sqrt(P)) diag(sign),
 * n = m * P; tmp holds n floats */
static void rht_one(float *v, int64_t n, const float *sign, const float *mat, int64_t m, int inverse, float *tmp) {
    const int64_t P = n / m;
    const float norm = (float)(1.0 / sqrt((double)P));
    if (inverse) mix(v, n, mat, m, tmp);
    else
        for (int64_t i = 0; i < n; i++) v[i] *= sign[i];
#if HAVE_AVX512 || HAVE_AVX2
    if (g_simd && P >= 8) fwht_rows(v, m, P);
    else
#endif
        fwht_rows_scalar(v, m, P);
    if (inverse)
        for (int64_t i = 0; i < n; i++) v[i] *= norm * sign[i]; /* sign is +-1: the same product as two steps */
    else {
        for (int64_t i = 0; i < n; i++) v[i] *= norm;
        mix(v, n, mat, m, tmp);
    }
}

/* in place on nvec contiguous vectors of length n */
API int accel_rht(float *data, int64_t nvec, int64_t n, const float *sign, const float *mat, int64_t m, int inverse,
                  int nthreads) {
    if (n < 1 || m < 1 || n % m || nvec < 0) return -1;
    int64_t P = n / m;
    if (P & (P - 1)) return -1;
    int nt = threads_for(nthreads, (double)nvec * n * 8);
#pragma omp parallel num_threads(nt)
    {
        float *tmp = xalloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nvec; i++) rht_one(data + i * n, n, sign, mat, m, inverse, tmp);
        free(tmp);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- affine (packed) */

typedef struct {
    const uint8_t *codes;
    int64_t nbytes; /* of the code stream */
    int bits, levels, symmetric, scale_f32, base_g, base_B;
    const void *scale, *offset;
    int64_t rows, cols, group, ngroups;
} Affine;

#if HAVE_AVX2
/* side_value of entries i .. i + 7 */
static inline __m256 side_values8(const void *p, int is_f32, int64_t i) {
    return is_f32 ? _mm256_loadu_ps((const float *)p + i)
                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
#endif

/* per row: float scales into sc and the row's constant term sum_g coef_g * gsum_g */
static float affine_row_sides(const Affine *a, int64_t r, const float *gsum, float *sc) {
    const int64_t ng = a->ngroups, first = r * ng;
    float mid = 0.5f * (float)(a->levels - 1);
#if HAVE_AVX512
    if (g_simd) {
        __m512 extra = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g += 16) {
            int64_t left = ng - g;
            __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
            __m512 s, coef;
            if (a->scale_f32) {
                s = _mm512_maskz_loadu_ps(m, (const float *)a->scale + first + g);
            } else {
                s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)a->scale + first + g));
            }
            _mm512_mask_storeu_ps(sc + g, m, s);
            if (a->symmetric) {
                coef = _mm512_mul_ps(s, _mm512_set1_ps(-mid));
            } else if (a->scale_f32) {
                coef = _mm512_maskz_loadu_ps(m, (const float *)a->offset + first + g);
            } else {
                coef = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)a->offset + first + g));
            }
            extra = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(m, gsum + g), extra);
        }
        return hsum(extra);
    }
#elif HAVE_AVX2
    if (g_simd && ng >= 8) {
        __m256 acc = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= ng; g += 8) {
            const __m256 s = side_values8(a->scale, a->scale_f32, first + g);
            _mm256_storeu_ps(sc + g, s);
            const __m256 coef = a->symmetric ? _mm256_mul_ps(s, _mm256_set1_ps(-mid))
                                             : side_values8(a->offset, a->scale_f32, first + g);
            acc = _mm256_fmadd_ps(coef, _mm256_loadu_ps(gsum + g), acc);
        }
        float extra = hsum8(acc);
        for (; g < ng; g++) {
            sc[g] = side_value(a->scale, a->scale_f32, first + g);
            extra += (a->symmetric ? -sc[g] * mid : side_value(a->offset, a->scale_f32, first + g)) * gsum[g];
        }
        return extra;
    }
#endif
    float extra = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        sc[g] = side_value(a->scale, a->scale_f32, first + g);
        float coef = a->symmetric ? -sc[g] * mid : side_value(a->offset, a->scale_f32, first + g);
        extra += coef * gsum[g];
    }
    return extra;
}

static float affine_row_generic(const Affine *a, int64_t r, const float *x, const float *gsum, float *sc) {
    float total = affine_row_sides(a, r, gsum, sc);
    for (int64_t g = 0; g < a->ngroups; g++) {
        int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
        float d = 0.0f;
        for (int64_t c = c0; c < c1; c++)
            d += (float)get_code(a->codes, (uint64_t)(r * a->cols + c) * (uint64_t)a->bits, a->bits) * x[c];
        total += sc[g] * d;
    }
    return total;
}

/* Streaming a weight from memory. One sequential stream per core reads at about 30 GB/s on two cores here, two
 * streams at about 46 (the large-copy bandwidth): the hardware prefetchers track a few lines ahead of each stream,
 * and one stream keeps too few misses in flight. So a thread that walks its tiles in order reads each line of the
 * current tile 4 KB ahead into L1 and, at the same offset, the line of its next tile into L2: the next tile streams
 * in while the current one is read, and is an L2 hit when its turn comes (tiles are <= a few hundred KB; L2 is 2
 * MB). bench/gemv.py measures the effect. */
/* The Leech tile kernels read a tile in this many parts in turn (blocks of 1 KB from each part alternately): more
 * demand streams, more misses in flight. 2 measured 1.08-1.18x faster than 1 on planes; 4 no faster than 2. */
#define TILE_STREAMS 2

AI void prefetch_line(const uint8_t *p, int64_t ahead) {
    __builtin_prefetch(p + 4096, 0, 3); /* prefetcht0 */
    if (ahead) __builtin_prefetch(p + ahead, 0, 1); /* prefetcht2 */
}

/* [*t0, *t1): this thread's share of n items, contiguous, in thread order */
__attribute__((unused)) static void thread_range(int64_t n, int64_t *t0, int64_t *t1) {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    *t0 = n * id / nt;
    *t1 = n * (id + 1) / nt;
}

#if HAVE_AVX512
/* a 16-bit mask straight from memory: kmovw k, m16 is a load, while the compiler's own choice (a GPR load, then
 * kmovw k, r32) spends a vector-port uop per mask, which the masked adds need */
AI __mmask16 ldmask(const uint8_t *p) {
    __mmask16 k;
    __asm__("kmovw %1, %0" : "=k"(k) : "m"(*(const uint16_t *)p));
    return k;
}

/* codes -> floats by vpermps: it reads only the low 4 bits of each lane, so a 16-entry table maps a lane holding
 * (byte >> shift) straight to the code's value, without a mask or an int -> float conversion */
AI __m512 code_table(const int bits) {
    return bits == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                     : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
}

/* 16 bytes of codes (v: one byte per 32-bit lane) times their inputs, added to d0..d3 */
AI void affine_step_t(__m512i v, __mmask16 m, const float *z0, const float *z1, const float *z2, const float *z3,
                      __m512 *d0, __m512 *d1, __m512 *d2, __m512 *d3, const int bits) {
    if (bits == 8) {
        *d0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_maskz_loadu_ps(m, z0), *d0);
    } else if (bits == 4) {
        const __m512 t = code_table(4);
        *d0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, t), _mm512_maskz_loadu_ps(m, z0), *d0);
        *d1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_maskz_loadu_ps(m, z1), *d1);
    } else {
        const __m512 t = code_table(2);
        *d0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, t), _mm512_maskz_loadu_ps(m, z0), *d0);
        *d1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 2), t), _mm512_maskz_loadu_ps(m, z1), *d1);
        *d2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_maskz_loadu_ps(m, z2), *d2);
        *d3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 6)), _mm512_maskz_loadu_ps(m, z3), *d3);
    }
}

/* sum over one group's bytes [b0, b1) of codes * inputs; zk: the input for code k of each byte */
AI __m512 affine_group_t(const uint8_t *row, int64_t b0, int64_t b1, const float *z0, const float *z1,
                         const float *z2, const float *z3, const int bits) {
    __m512 d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps(), d2 = _mm512_setzero_ps(), d3 = _mm512_setzero_ps();
    __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps(), e2 = _mm512_setzero_ps(), e3 = _mm512_setzero_ps();
    int64_t b = b0;
    for (; b + 32 <= b1; b += 32) { /* two independent chains */
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b)));
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b + 16)));
        affine_step_t(v, 0xffff, z0 + b, z1 + b, z2 + b, z3 + b, &d0, &d1, &d2, &d3, bits);
        affine_step_t(w, 0xffff, z0 + b + 16, z1 + b + 16, z2 + b + 16, z3 + b + 16, &e0, &e1, &e2, &e3, bits);
    }
    for (; b < b1; b += 16) {
        int64_t left = b1 - b;
        __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, row + b));
        affine_step_t(v, m, z0 + b, z1 + b, z2 + b, z3 + b, &d0, &d1, &d2, &d3, bits);
    }
    __m512 d = _mm512_add_ps(_mm512_add_ps(d0, e0), _mm512_add_ps(d1, e1));
    return bits == 2 ? _mm512_add_ps(d, _mm512_add_ps(_mm512_add_ps(d2, e2), _mm512_add_ps(d3, e3))) : d;
}

/* zd: the input deinterleaved by code position within a byte: zd[k * nbr + i] = x[i * per + k] (NULL for 8 bits) */
AI float affine_row_t(const Affine *a, int64_t r, const float *x, const float *zd, const float *gsum, float *sc,
                      const int bits) {
    float extra = affine_row_sides(a, r, gsum, sc);
    const int per = 8 / bits;
    const int64_t nbr = a->cols / per, gbytes = a->group / per; /* a group is a whole number of bytes */
    const uint8_t *row = a->codes + (r * a->cols) / per;
    const float *z0 = zd ? zd : x, *z1 = zd ? zd + nbr : x, *z2 = zd ? zd + 2 * nbr : x, *z3 = zd ? zd + 3 * nbr : x;
    __m512 acc = _mm512_setzero_ps();
    int64_t b0 = 0;
    for (int64_t g = 0; g < a->ngroups; g++, b0 += gbytes) {
        int64_t b1 = b0 + gbytes < nbr ? b0 + gbytes : nbr;
        _mm_prefetch((const char *)(row + b0 + 4096), _MM_HINT_T0);
        acc = _mm512_fmadd_ps(affine_group_t(row, b0, b1, z0, z1, z2, z3, bits), _mm512_set1_ps(sc[g]), acc);
    }
    return hsum(acc) + extra;
}

/* 4 and 2 bits: the group's scale is folded into the code table (t = s * [0, 1, 2, ...]), so the code lanes
 * accumulate straight into per-code-position sums across groups, with no per-group reduction */
AI void lut_step_t(__m512i v, __mmask16 m, __m512 t, const float *z0, const float *z1, const float *z2,
                   const float *z3, __m512 *d0, __m512 *d1, __m512 *d2, __m512 *d3, const int bits) {
    *d0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, t), _mm512_maskz_loadu_ps(m, z0), *d0);
    if (bits == 4) {
        *d1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_maskz_loadu_ps(m, z1), *d1);
    } else {
        *d1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 2), t), _mm512_maskz_loadu_ps(m, z1), *d1);
        *d2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_maskz_loadu_ps(m, z2), *d2);
        *d3 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 6), t), _mm512_maskz_loadu_ps(m, z3), *d3);
    }
}

AI float affine_row_lut_t(const Affine *a, int64_t r, const float *zd, const float *gsum, float *sc,
                          const int bits) {
    float extra = affine_row_sides(a, r, gsum, sc);
    const int per = 8 / bits;
    const int64_t nbr = a->cols / per, gbytes = a->group / per;
    const uint8_t *row = a->codes + (r * a->cols) / per;
    const float *z0 = zd, *z1 = zd + nbr, *z2 = zd + 2 * nbr, *z3 = zd + 3 * nbr;
    const __m512 base = code_table(bits);
    __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0, e0 = d0, e1 = d0;
    int64_t b0 = 0;
    for (int64_t g = 0; g < a->ngroups; g++, b0 += gbytes) {
        const int64_t b1 = b0 + gbytes < nbr ? b0 + gbytes : nbr;
        const __m512 t = _mm512_mul_ps(base, _mm512_set1_ps(sc[g]));
        _mm_prefetch((const char *)(row + b0 + 4096), _MM_HINT_T0);
        int64_t b = b0;
        if (bits == 4)
            for (; b + 32 <= b1; b += 32) { /* two steps into separate sums: the FMA latency is not the limit */
                lut_step_t(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b))), 0xffff, t, z0 + b,
                           z1 + b, z2, z3, &d0, &d1, &d2, &d3, 4);
                lut_step_t(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b + 16))), 0xffff, t,
                           z0 + b + 16, z1 + b + 16, z2, z3, &e0, &e1, &d2, &d3, 4);
            }
        for (; b + 16 <= b1; b += 16)
            lut_step_t(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b))), 0xffff, t, z0 + b, z1 + b,
                       z2 + b, z3 + b, &d0, &d1, &d2, &d3, bits);
        if (b < b1) {
            __mmask16 m = (__mmask16)((1u << (b1 - b)) - 1u);
            lut_step_t(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, row + b)), m, t, z0 + b, z1 + b, z2 + b, z3 + b,
                       &d0, &d1, &d2, &d3, bits);
        }
    }
    __m512 d = _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(e0, e1));
    return hsum(_mm512_add_ps(d, _mm512_add_ps(d2, d3))) + extra;
}

static float affine_row_simd(const Affine *a, int64_t r, const float *x, const float *zd, const float *gsum,
                             float *sc) {
    switch (a->bits) {
    case 8: return affine_row_t(a, r, x, zd, gsum, sc, 8);
    case 4: return affine_row_lut_t(a, r, zd, gsum, sc, 4);
    default: return affine_row_lut_t(a, r, zd, gsum, sc, 2);
    }
}
#elif HAVE_AVX2

/* 8 bytes of codes (v: one byte per 32-bit lane) times their inputs (zk: the input of code position k of each
 * byte, 8 lanes from zk[0]; `keep` the lanes to read), added to d[0 .. 8 / bits) */
AI __m256 load8(const float *z, __m256i keep, const int full) {
    return full ? _mm256_loadu_ps(z) : _mm256_maskload_ps(z, keep);
}

AI void affine_step8(__m256i v, __m256i keep, const int full, const float *z0, const float *z1, const float *z2,
                     const float *z3, __m256 *d, const int bits) {
    if (bits == 8) {
        d[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), load8(z0, keep, full), d[0]);
        return;
    }
    const __m256i m = _mm256_set1_epi32((1 << bits) - 1);
    const float *z[4] = {z0, z1, z2, z3};
    for (int k = 0; k < 8 / bits; k++) {
        const __m256i c = k ? _mm256_srli_epi32(v, bits * k) : v;
        const __m256 q = _mm256_cvtepi32_ps(k == 8 / bits - 1 ? c : _mm256_and_si256(c, m));
        d[k] = _mm256_fmadd_ps(q, load8(z[k], keep, full), d[k]);
    }
}

/* sum over bytes [b0, b1) of a row of codes * inputs, two chains of partial sums */
AI __m256 affine_group8(const uint8_t *row, int64_t b0, int64_t b1, const float *z0, const float *z1,
                        const float *z2, const float *z3, const int bits) {
    __m256 d[4], e[4];
    for (int k = 0; k < 4; k++) d[k] = e[k] = _mm256_setzero_ps();
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t b = b0;
    for (; b + 16 <= b1; b += 16) {
        affine_step8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + b))), all, 1, z0 + b, z1 + b, z2 + b,
                     z3 + b, d, bits);
        affine_step8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + b + 8))), all, 1, z0 + b + 8,
                     z1 + b + 8, z2 + b + 8, z3 + b + 8, e, bits);
    }
    for (; b < b1; b += 8) { /* the tail: only its own bytes read (the last row ends the stream) */
        const int64_t left = b1 - b < 8 ? b1 - b : 8;
        uint64_t word = 0;
        memcpy(&word, row + b, (size_t)left);
        affine_step8(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)word)), lanes8(left), 0, z0 + b, z1 + b, z2 + b,
                     z3 + b, d, bits);
    }
    for (int k = 0; k < 4; k++) d[k] = _mm256_add_ps(d[k], e[k]);
    return _mm256_add_ps(_mm256_add_ps(d[0], d[1]), _mm256_add_ps(d[2], d[3]));
}

/* the AVX2 row of a byte-aligned packed stream (8, 4 or 2 bits; zd as for the AVX-512 path, NULL for 8 bits) */
AI float affine_row8_t(const Affine *a, int64_t r, const float *x, const float *zd, const float *gsum, float *sc,
                       const int bits) {
    float extra = affine_row_sides(a, r, gsum, sc);
    const int per = 8 / bits;
    const int64_t nbr = a->cols / per, gbytes = a->group / per;
    const uint8_t *row = a->codes + (r * a->cols) / per;
    const float *z0 = zd ? zd : x, *z1 = zd ? zd + nbr : x, *z2 = zd ? zd + 2 * nbr : x, *z3 = zd ? zd + 3 * nbr : x;
    __m256 acc = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (int64_t g = 0; g < a->ngroups; g++, b0 += gbytes) {
        const int64_t b1 = b0 + gbytes < nbr ? b0 + gbytes : nbr;
        _mm_prefetch((const char *)(row + b0 + 4096), _MM_HINT_T0);
        acc = _mm256_fmadd_ps(affine_group8(row, b0, b1, z0, z1, z2, z3, bits), _mm256_set1_ps(sc[g]), acc);
    }
    return hsum8(acc) + extra;
}

static float affine_row_simd(const Affine *a, int64_t r, const float *x, const float *zd, const float *gsum,
                             float *sc) {
    switch (a->bits) {
    case 8: return affine_row8_t(a, r, x, zd, gsum, sc, 8);
    case 4: return affine_row8_t(a, r, x, zd, gsum, sc, 4);
    default: return affine_row8_t(a, r, x, zd, gsum, sc, 2);
    }
}
#endif

static int affine_check(const Affine *a) {
    if (a->bits < 1 || a->bits > 8 || a->levels < 2 || a->levels > 256 || a->rows < 0 || a->cols < 0 ||
        a->group < 1)
        return -1;
    return 0;
}

/* can a row be read byte-aligned with whole groups on byte boundaries? */
static int affine_fast(const Affine *a) {
    if (!g_simd || a->base_g) return 0;
    if (a->bits != 8 && a->bits != 4 && a->bits != 2) return 0;
    int per = 8 / a->bits;
    return a->cols % per == 0 && a->group % per == 0;
}

static float *group_sums(const float *x, int64_t cols, int64_t group, int64_t ngroups) {
    float *gs = xalloc((size_t)ngroups * sizeof(float));
    for (int64_t g = 0; g < ngroups; g++) { /* four partial sums: one chain of double adds was 1 ns a column */
        int64_t c0 = g * group, c1 = c0 + group < cols ? c0 + group : cols, c = c0;
        double s[4] = {0.0, 0.0, 0.0, 0.0};
        for (; c + 4 <= c1; c += 4)
            for (int i = 0; i < 4; i++) s[i] += x[c + i];
        for (; c < c1; c++) s[0] += x[c];
        gs[g] = (float)((s[0] + s[1]) + (s[2] + s[3]));
    }
    return gs;
}

/* ----------------------------------------------------------------------------------------- affine (base-L) */

/* digits of group values: a lookup table of all 2^B values when B <= 16 (values past L^g, which only a corrupt
 * stream holds, decode to zeros), else division */
typedef struct {
    uint8_t *table; /* 2^B entries of 8 bytes (the digits), or NULL */
} BaseTable;

static BaseTable base_table(int L, int g, int B) {
    BaseTable t = {NULL};
    if (B > 16) return t;
    int64_t valid = 1;
    for (int j = 0; j < g; j++) valid *= L;
    t.table = xalloc((size_t)8 << B);
    memset(t.table, 0, (size_t)8 << B);
    for (int64_t v = 0; v < valid; v++) {
        int64_t rest = v;
        for (int j = 0; j < g; j++, rest /= L) t.table[v * 8 + j] = (uint8_t)(rest % L);
    }
    return t;
}

/* codes [k0, k0 + count) of a base-L stream into out[0 .. count); out has 8 bytes of slack, since every group
 * is written as one 8-byte store (its digits, then bytes the next group overwrites) */
static void base_unpack(const Affine *a, const BaseTable *t, int64_t k0, int64_t count, uint8_t *out) {
    const int g = a->base_g, B = a->base_B;
    const uint64_t L = (uint64_t)a->levels;
    int64_t grp = k0 / g, pos = grp * g - k0; /* where the group's digit 0 lands in out (< 0 for the first) */
    uint64_t bitpos = (uint64_t)grp * (uint64_t)B;
    for (; pos < count; pos += g, bitpos += (uint64_t)B) {
        if (B == 8 && t->table && pos >= 0) { /* one byte a group (L = 3): a table load and a store per group */
            const uint8_t *src = a->codes + (bitpos >> 3), *tab = t->table;
            for (int64_t i = 0, n = (count - pos + g - 1) / g; i < n; i++)
                memcpy(out + pos + i * g, tab + 8 * (size_t)src[i], 8);
            return;
        }
        uint64_t v = get_wide(a->codes, a->nbytes, bitpos, B), digits = 0;
        if (t->table) {
            memcpy(&digits, t->table + 8 * v, 8);
        } else {
            for (int j = 0; j < g; j++, v /= L) digits |= (v % L) << (8 * j);
        }
        if (pos >= 0) {
            memcpy(out + pos, &digits, 8);
        } else {
            for (int64_t j = -pos; j < g && pos + j < count; j++) out[pos + j] = (uint8_t)(digits >> (8 * j));
        }
    }
}

static float affine_row_bytes(const Affine *a, int64_t r, const uint8_t *q, const float *x, const float *gsum,
                              float *sc) {
    float total = affine_row_sides(a, r, gsum, sc);
#if HAVE_AVX512
    if (g_simd) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < a->ngroups; g++) {
            int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
            acc = _mm512_fmadd_ps(affine_group_t(q, c0, c1, x, x, x, x, 8), _mm512_set1_ps(sc[g]), acc);
        }
        return total + hsum(acc);
    }
#elif HAVE_AVX2
    if (g_simd) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < a->ngroups; g++) {
            int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
            acc = _mm256_fmadd_ps(affine_group8(q, c0, c1, x, x, x, x, 8), _mm256_set1_ps(sc[g]), acc);
        }
        return total + hsum8(acc);
    }
#endif
    for (int64_t g = 0; g < a->ngroups; g++) {
        int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
        float d = 0.0f;
        for (int64_t c = c0; c < c1; c++) d += (float)q[c] * x[c];
        total += sc[g] * d;
    }
    return total;
}

/* base_g = 0: packed layout with `bits`; base_g > 0: base-L layout with groups of base_g codes in base_B bits */
API int accel_affine_matvec(const uint8_t *codes, int64_t nbytes, int bits, int levels, int base_g, int base_B,
                            int symmetric, int scale_f32, const void *scale, const void *offset, int64_t rows,
                            int64_t cols, int64_t group, const float *x, float *y, int nthreads) {
    Affine a = {codes, nbytes, bits, levels, symmetric, scale_f32, base_g, base_B, scale, offset, rows, cols, group,
                (cols + group - 1) / group};
    if (affine_check(&a) || (!symmetric && !offset) || (base_g && (base_g > 8 || base_B < 1 || base_B > 64)))
        return -1;
    float *gs = group_sums(x, cols, group, a.ngroups);
    int fast = affine_fast(&a);
    float *zd = NULL;
    if (fast && bits < 8) {
        int per = 8 / bits;
        int64_t nbr = cols / per;
        zd = xalloc((size_t)cols * sizeof(float));
        for (int k = 0; k < per; k++)
            for (int64_t i = 0; i < nbr; i++) zd[k * nbr + i] = x[i * per + k];
    }
    BaseTable table = {NULL};
    if (base_g) table = base_table(levels, base_g, base_B);
    int nt = threads_for(nthreads, (double)rows * cols);
#pragma omp parallel num_threads(nt)
    {
        float *sc = xalloc((size_t)a.ngroups * sizeof(float));
        uint8_t *q = base_g ? xalloc((size_t)cols + 8) : NULL;
#pragma omp for schedule(guided, 16) /* a thread the OS parks does not hold up the rest */
        for (int64_t r = 0; r < rows; r++) {
            if (base_g) {
                base_unpack(&a, &table, r * cols, cols, q);
                y[r] = affine_row_bytes(&a, r, q, x, gs, sc);
            } else {
#if HAVE_AVX512 || HAVE_AVX2
                if (fast) {
                    y[r] = affine_row_simd(&a, r, x, zd, gs, sc);
                    continue;
                }
#endif
                y[r] = affine_row_generic(&a, r, x, gs, sc);
            }
        }
        free(sc);
        free(q);
    }
    free(table.table);
    free(zd);
    free(gs);
    return 0;
}

/* rows [r0, r1) of the decoded weight, float32 as the format decodes it (q * scale + offset, no fused multiply) */
API int accel_affine_decode_rows(const uint8_t *codes, int64_t nbytes, int bits, int levels, int base_g, int base_B,
                                 int symmetric, int scale_f32, const void *scale, const void *offset, int64_t rows,
                                 int64_t cols, int64_t group, int64_t r0, int64_t r1, float *out, int nthreads) {
    Affine a = {codes, nbytes, bits, levels, symmetric, scale_f32, base_g, base_B, scale, offset, rows, cols, group,
                (cols + group - 1) / group};
    if (affine_check(&a) || (!symmetric && !offset) || r0 < 0 || r1 > rows || r0 > r1) return -1;
    BaseTable table = {NULL};
    if (base_g) table = base_table(levels, base_g, base_B);
    float mid = 0.5f * (float)(levels - 1);
    int nt = threads_for(nthreads, (double)(r1 - r0) * cols);
#pragma omp parallel num_threads(nt)
    {
        uint8_t *q = xalloc((size_t)cols + 8);
#pragma omp for schedule(static)
        for (int64_t r = r0; r < r1; r++) {
            if (base_g) {
                base_unpack(&a, &table, r * cols, cols, q);
            } else {
                for (int64_t c = 0; c < cols; c++)
                    q[c] = (uint8_t)get_code(codes, (uint64_t)(r * cols + c) * (uint64_t)bits, bits);
            }
            float *o = out + (r - r0) * cols;
            for (int64_t g = 0; g < a.ngroups; g++) {
                int64_t c0 = g * group, c1 = c0 + group < cols ? c0 + group : cols;
                float s = side_value(scale, scale_f32, r * a.ngroups + g);
                if (symmetric) {
                    for (int64_t c = c0; c < c1; c++) o[c] = ((float)q[c] - mid) * s;
                } else {
                    float off = side_value(offset, scale_f32, r * a.ngroups + g);
                    for (int64_t c = c0; c < c1; c++) {
                        o[c] = (float)q[c] * s + off; /* two roundings: built with -ffp-contract=off */
                    }
                }
            }
        }
        free(q);
    }
    free(table.table);
    return 0;
}

/* ------------------------------------------------------------------------------------------------- Leech */

enum { LEECH_PLANES = 0, LEECH_ONEHOT = 1 };

typedef struct {
    int nstages;
    const uint8_t *stream[2];
    int64_t stream_bytes[2];
    int layout[2]; /* LEECH_PLANES / LEECH_ONEHOT */
    int param[2];  /* planes: bits per coordinate; onehot: K magnitude masks */
    float alpha[2];
    const uint16_t *scale; /* fp16, one per row */
    int64_t rows, cols, nblk; /* cols padded to 24 * nblk; nblk = blocks per row */
    const uint8_t *tiled[2]; /* a 4-plane stage's 16-row tile copy (see "Leech planes, 16-row tiles"), or NULL */
} Leech;

static inline int parity_bit(const uint8_t *par, int64_t k) { return (par[k >> 3] >> (k & 7)) & 1; }

/* sum over the row's blocks of parity * zb (planes: x = 2 v + p, so p contributes p * sum of the block's z) */
static float parity_term(const uint8_t *par, int64_t parbytes, int64_t first, int64_t nblk, const float *zb) {
    float total = 0.0f;
    (void)parbytes; /* only the AVX-512 path reads words */
#if HAVE_AVX512
    if (g_simd) {
        __m512 acc = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b < nblk; b += 16) {
            int64_t left = nblk - b;
            int take = left >= 16 ? 16 : (int)left;
            __mmask16 m = (__mmask16)get_bits(par, parbytes, (uint64_t)(first + b), take);
            acc = _mm512_mask_add_ps(acc, m, acc, _mm512_maskz_loadu_ps((__mmask16)((1u << take) - 1u), zb + b));
        }
        return hsum(acc);
    }
#elif HAVE_AVX2
    if (g_simd) { /* 8 blocks a step: each parity bit spread to a lane mask (random bits: a branch mispredicts) */
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblk; b += 8) {
            const int take = nblk - b >= 8 ? 8 : (int)(nblk - b);
            const __m256i m = _mm256_set1_epi32((int)get_bits(par, parbytes, (uint64_t)(first + b), take));
            const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(m, bit), bit);
            acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_castsi256_ps(on), _mm256_maskload_ps(zb + b, lanes8(take))));
        }
        return hsum8(acc);
    }
#endif
    for (int64_t b = 0; b < nblk; b++) total += parity_bit(par, first + b) ? zb[b] : 0.0f; /* no branch */
    return total;
}

#if HAVE_AVX512
/* out[i] = the parity term of the 16 rows of a tile from its parity tile copy ([word][row] uint32, word k = blocks
 * 32 k .. 32 k + 31 of the row): nibble n of a word indexes ptab's table 8 k + n of the subset sums of zb over its 4
 * blocks (vpermps reads the low 4 bits of a lane, so a shift is the whole decode): 3 operations per 4 blocks of 16
 * rows, where parity_term takes about 10 per 16 blocks of one row. */
static void parity_tiled(const uint32_t *pt, int64_t words, const float *ptab, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < words; k++) {
        const __m512i v = _mm512_loadu_si512(pt + 16 * k);
        const float *tb = ptab + 128 * k;
        for (int n = 0; n < 8; n += 2) {
            a0 = _mm512_add_ps(a0, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * n), _mm512_loadu_ps(tb + 16 * n)));
            a1 = _mm512_add_ps(a1, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * n + 4),
                                                         _mm512_loadu_ps(tb + 16 * n + 16)));
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(a0, a1));
}
#endif

/* The spread parity of a onehot tile copy's step k (coordinates 32 k .. 32 k + 31) for the rows at row0 of its
 * parity words pw ([word][16 rows], bit b = block b): those coordinates lie in blocks b0 = 4 k / 3 and b0 + 1, the
 * first 24, 16 or 8 of them (k mod 3 = 0, 1, 2) in b0, so two bits of each row's word select two constant masks;
 * past the row the words are zero. One definition for 16 and 8 rows (GCC vector extensions on 32-bit lanes). */
#define SPREAD_PARITY(name, U)                                                                                        \
    AI U name(const uint32_t *pw, int64_t pwords, int64_t k, int row0) {                                              \
        const int64_t b0 = 4 * k / 3, w = b0 / 32;                                                                    \
        const int sh = (int)(b0 % 32);                                                                                \
        U pb = {0}, next = {0};                                                                                       \
        if (w < pwords) {                                                                                             \
            memcpy(&pb, pw + 16 * w + row0, sizeof pb);                                                               \
            pb >>= sh;                                                                                                \
        }                                                                                                             \
        if (sh == 31 && w + 1 < pwords) {                                                                             \
            memcpy(&next, pw + 16 * (w + 1) + row0, sizeof next);                                                     \
            pb |= next << 1;                                                                                          \
        }                                                                                                             \
        const uint32_t m0 = 0xffffffffu >> (8 + 8 * (k % 3));                                                         \
        return (-(pb & 1) & m0) | (-((pb >> 1) & 1) & ~m0); /* all ones where b0 (b0 + 1) is odd */                 \
    }
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#if HAVE_AVX512
SPREAD_PARITY(spread_parity16, u32x16)
#endif
#if HAVE_AVX2
SPREAD_PARITY(spread_parity8, u32x8)
#endif

/* A onehot stage is turned into planes on the fly, bit-sliced (each operation handles 32 coordinates of 16 rows):
 * with m = sum_k k [mask k], p the parity and s the sign, x = (1 - 2 s)(2 m + p) = 2 v + p for
 * v = s ? -(m + p) : m, computed as u = m + (p & s), v = (u ^ s) + s in two's complement on nb + 1 bits
 * (nb = bits of K + 1). The planes of v then go through the planes lookups; p through the parity term. */
#define ONEHOT_SLICE(T, ZERO, Mk, Pm, S, V, K, nb)                                                                     \
    do {                                                                                                           \
        T u[4], carry = (Pm) & (S);                                                                                \
        for (int q = 0; q < (nb); q++) {                                                                           \
            T mq = (ZERO);                                                                                         \
            for (int m = 1; m <= (K); m++)                                                                         \
                if ((m >> q) & 1) mq = mq | (Mk)[m - 1];                                                           \
            u[q] = mq ^ carry;                                                                                     \
            carry = mq & carry;                                                                                    \
        }                                                                                                          \
        carry = (S);                                                                                               \
        for (int q = 0; q <= (nb); q++) {                                                                          \
            T w = (q < (nb) ? u[q] : (ZERO)) ^ (S);                                                                \
            (V)[q] = w ^ carry;                                                                                    \
            carry = w & carry;                                                                                     \
        }                                                                                                          \
    } while (0)

static inline int onehot_value_bits(const int K) { return (K + 1) >= 4 ? 3 : ((K + 1) >= 2 ? 2 : 1); }

/* F(args..., K) with K a compile-time constant (the inlined kernels unroll their per-mask loops): K = 1 .. 6 */
#define ONEHOT_DISPATCH(K, F, ...)                                                                                     \
    do {                                                                                                               \
        switch (K) {                                                                                                   \
        case 6: F(__VA_ARGS__, 6); break;                                                                              \
        case 2: F(__VA_ARGS__, 2); break;                                                                              \
        case 1: F(__VA_ARGS__, 1); break;                                                                              \
        case 3: F(__VA_ARGS__, 3); break;                                                                              \
        case 4: F(__VA_ARGS__, 4); break;                                                                              \
        default: F(__VA_ARGS__, 5); break;                                                                             \
        }                                                                                                              \
    } while (0)

/* The Leech row kernels look every nibble of a plane up in a 16-entry table of the subset sums of the 4 inputs it
 * covers: tab[16 g + i] = sum of z[4 g + t] over the set bits t of i. One table serves every plane and every row. */
static void build_tables(const float *z, int64_t cols, float *tab) {
    for (int64_t g = 0; g < cols / 4; g++) {
        const float *q = z + 4 * g;
        float *t = tab + 16 * g;
        t[0] = 0.0f;
        t[1] = q[0];
        t[2] = q[1];
        t[3] = q[0] + q[1];
        t[4] = q[2];
        t[5] = q[0] + q[2];
        t[6] = q[1] + q[2];
        t[7] = t[3] + q[2];
        for (int i = 0; i < 8; i++) t[8 + i] = t[i] + q[3];
    }
}

/* a byte's contribution by table lookup (the scalar tail of a tile) */
static inline float byte_lookup(const float *tab, int64_t k, unsigned byte) {
    return tab[32 * k + (byte & 15)] + tab[32 * k + 16 + (byte >> 4)];
}

/* the scalar tail of a tile, bytes [k, rowbytes) of its nr rows at p: out[i] += their planes' (onehot: their
 * bit-sliced v's) contributions */
static void planes_tail(const uint8_t *p, int64_t plane_stride, int64_t rowbytes, int64_t k, int nr, const float *tab,
                        float *out, int bits) {
    for (; k < rowbytes; k++)
        for (int i = 0; i < nr; i++)
            for (int j = 0; j < bits; j++) {
                float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
                out[i] += w * byte_lookup(tab, k, p[i * rowbytes + j * plane_stride + k]);
            }
}

static void onehot_tail(const uint8_t *p, int64_t plane_stride, int64_t rowbytes, int64_t k, int nr,
                        const uint8_t *pm, const float *tab, float *out, int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    for (; k < rowbytes; k++)
        for (int i = 0; i < nr; i++) {
            unsigned M[6], V[4];
            for (int m = 0; m < K; m++) M[m] = p[i * rowbytes + m * plane_stride + k];
            unsigned S = p[i * rowbytes + K * plane_stride + k], P = pm[i * rowbytes + k];
            ONEHOT_SLICE(unsigned, 0u, M, P, S, V, K, nb);
            for (int j = 0; j < bits; j++) {
                float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
                out[i] += w * byte_lookup(tab, k, V[j] & 0xffu);
            }
        }
}

#if HAVE_AVX512
/* The AVX-512 Leech kernels work on tiles of 16 rows: one dword gather per plane brings 4 bytes (32 coordinates)
 * of each of the 16 rows into the 16 lanes, and vpermps looks every nibble up in the tables, so a nibble of a
 * plane costs a shift, a permute and an add for 16 rows at once. */

AI __m512i tile_offsets(int64_t rowbytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)rowbytes));
}

/* The gathers jump between 16 rows, which the hardware prefetcher does not follow, but the next tile's bytes of a
 * plane are one contiguous run of 16 rows: while this tile reads bytes [k, k + kstep) of its rows, fetch bytes
 * [16 k, 16 (k + kstep)) of that run, so the next tile arrives spread over this one. */
AI void tile_prefetch(const uint8_t *p, int64_t rowbytes, int64_t plane_stride, int planes, int64_t k, int kstep) {
    const uint8_t *next = p + 16 * rowbytes;
    for (int j = 0; j < planes; j++)
        for (int64_t off = 16 * k; off < 16 * (k + kstep); off += 64)
            _mm_prefetch((const char *)(next + j * plane_stride + off), _MM_HINT_T0);
}


/* out[lane] = sum_j w_j acc_j with the two's complement plane weights (the top plane -2^j) */
AI void store_planes(const __m512 *acc, const int bits, __mmask16 lanes, float *out) {
    __m512 v = _mm512_setzero_ps();
    for (int j = 0; j < bits; j++) {
        float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
        v = _mm512_fmadd_ps(acc[j], _mm512_set1_ps(w), v);
    }
    _mm512_mask_storeu_ps(out, lanes, v);
}

/* 8 bytes of each of the 16 rows at q + row offset, as two dword vectors (bytes 0-3 and 4-7 of every row): two
 * qword gathers and two permutes, cheaper than two dword gathers (a gather costs about one load per element) */
AI void gather_pair(const uint8_t *q, __m256i vlo, __m256i vhi, __mmask16 lanes, __m512i *g0, __m512i *g1) {
    const __m512i A = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)lanes, vlo, q, 1);
    const __m512i B = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)(lanes >> 8), vhi, q, 1);
    *g0 = _mm512_permutex2var_epi32(
        A, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), B);
    *g1 = _mm512_permutex2var_epi32(
        A, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), B);
}

/* the 4 bytes (8 nibbles) of one dword per lane of each plane, looked up in the tables at tk, into acc */
AI void lookup_dword(const __m512i *G, const float *tk, __m512 *acc, const int bits) {
    for (int j = 0; j < bits; j++) /* plane by plane: the tables stay memory operands, nothing spills */
        for (int b = 0; b < 4; b++) {
            __m512i g = b ? _mm512_srli_epi32(G[j], 8 * b) : G[j];
            acc[j] = _mm512_add_ps(acc[j], _mm512_add_ps(_mm512_permutexvar_ps(g, _mm512_load_ps(tk + 32 * b)),
                                                         _mm512_permutexvar_ps(_mm512_srli_epi32(g, 4),
                                                                               _mm512_load_ps(tk + 32 * b + 16))));
        }
}

/* out[i] = sum_c v_c z_c for rows r0 + i, i < nr, of a planes stage (v: `bits`-bit two's complement) */
AI void planes_tile_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                      const float *tab, float *out, const int bits) {
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    const __m512i vidx = tile_offsets(rowbytes);
    const __m256i vlo = _mm512_castsi512_si256(vidx), vhi = _mm512_extracti64x4_epi64(vidx, 1);
    const uint8_t *p = base + r0 * rowbytes;
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= rowbytes; k += 8) {
        tile_prefetch(p, rowbytes, plane_stride, bits, k, 8);
        __m512i G0[4], G1[4];
        for (int j = 0; j < bits; j++) gather_pair(p + j * plane_stride + k, vlo, vhi, lanes, &G0[j], &G1[j]);
        lookup_dword(G0, tab + 32 * k, acc, bits);
        lookup_dword(G1, tab + 32 * (k + 4), acc, bits);
    }
    for (; k + 4 <= rowbytes; k += 4) {
        __m512i G[4];
        for (int j = 0; j < bits; j++)
            G[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + j * plane_stride + k, 1);
        lookup_dword(G, tab + 32 * k, acc, bits);
    }
    store_planes(acc, bits, lanes, out);
    planes_tail(p, plane_stride, rowbytes, k, nr, tab, out, bits);
}

/* out[i] = sum_c v_c z_c (see above) for rows r0 + i of a onehot stage; pm: the tile's parity spread to one bit
 * per coordinate (row i at pm + i * rowbytes) */
AI void onehot_tile_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                      const uint8_t *pm, const float *tab, float *out, const int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    const __m512i vidx = tile_offsets(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= rowbytes; k += 4) {
        tile_prefetch(p, rowbytes, plane_stride, K + 1, k, 4);
        __m512i M[6], V[4];
        for (int m = 0; m < K; m++)
            M[m] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + m * plane_stride + k, 1);
        __m512i S = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + K * plane_stride + k, 1);
        __m512i P = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, pm + k, 1);
        ONEHOT_SLICE(__m512i, _mm512_setzero_si512(), M, P, S, V, K, nb);
        lookup_dword(V, tab + 32 * k, acc, bits);
    }
    store_planes(acc, bits, lanes, out);
    onehot_tail(p, plane_stride, rowbytes, k, nr, pm, tab, out, K);
}

/* Step k of a onehot tile copy: its lines read (and the next tile's prefetched, `ahead` bytes on), its spread
 * parity taken from the parity words pw (spread_parity16), and the planes of v bit-sliced into V (planes 0 .. nb). */
AI void onehot_tiled_step(const uint8_t *tile, int64_t k, int64_t ahead, const uint32_t *pw, int64_t pwords,
                          __m512i *V, const int K) {
    const int nb = onehot_value_bits(K);
    const uint8_t *q = tile + k * (K + 1) * 64;
    for (int m = 0; m <= K; m++) prefetch_line(q + m * 64, ahead);
    __m512i M[6];
    for (int m = 0; m < K; m++) M[m] = _mm512_loadu_si512(q + m * 64);
    const __m512i S = _mm512_loadu_si512(q + K * 64);
    const __m512i P = (__m512i)spread_parity16(pw, pwords, k, 0);
    ONEHOT_SLICE(__m512i, _mm512_setzero_si512(), M, P, S, V, K, nb);
}

/* onehot_tile_t on a 16-row tile copy of the stage (tile[k][plane][16 rows][4 bytes], K masks then the sign, zero
 * past a row's end): the same bit slicing and lookups, with plain loads instead of K + 1 gathers a step, and the
 * spread parity from the tile's parity words pw (pwords of them, [word][16 rows]). tab must cover
 * 4 * ceil(rowbytes / 4) bytes (zero past the row). */
AI void onehot_tiled_tile_t(const uint8_t *tile, int64_t steps, int nr, const uint32_t *pw, int64_t pwords,
                            const float *tab, float *out, const int K) {
    const int64_t ahead = steps * (K + 1) * 64; /* the next tile */
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    const int64_t nch = (steps + 7) / 8, part = (nch + TILE_STREAMS - 1) / TILE_STREAMS; /* chunks of 8 steps */
    for (int64_t ci = 0; ci < part * TILE_STREAMS; ci++) { /* the parts of the tile in turn ("Streaming") */
        const int64_t c = (ci % TILE_STREAMS) * part + ci / TILE_STREAMS, k1 = c * 8 + 8 < steps ? c * 8 + 8 : steps;
        if (c >= nch) continue;
        for (int64_t k = c * 8; k < k1; k++) {
            __m512i V[4];
            onehot_tiled_step(tile, k, ahead, pw, pwords, V, K);
            lookup_dword(V, tab + 128 * k, acc, bits);
        }
    }
    store_planes(acc, bits, lanes, out);
}

static void onehot_tiled_tile(const uint8_t *tile, int64_t steps, int nr, const uint32_t *pw, int64_t pwords,
                              const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tiled_tile_t, tile, steps, nr, pw, pwords, tab, out);
}

static void planes_tile(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr, const float *tab,
                        float *out, int bits) {
    switch (bits) {
    case 4: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 4); break;
    case 3: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 3); break;
    case 2: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 2); break;
    default: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 1); break;
    }
}

static void onehot_tile(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr, const uint8_t *pm,
                        const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tile_t, base, stride, rowbytes, r0, nr, pm, tab, out);
}
#endif

#if HAVE_AVX2
/* The AVX2 Leech kernels: the AVX-512 tile scheme on 8 rows (a 16-row tile in two halves). vpermps reads 3 bits of
 * a lane, so a nibble's 16-entry lookup is two permutes (entries 0-7, 8-15) and a blend on bit 3. */
AI __m256 lookup16(__m256i g, const float *t) {
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(t), g);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), g);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(g, 28)));
}

/* parity_tiled (AVX-512, above) on two halves of 8 rows, with lookup16: 6 operations per 4 blocks of 8 rows, where
 * parity_term takes about 6 per 8 blocks of one row */
static void parity_tiled(const uint32_t *pt, int64_t words, const float *ptab, float *out) {
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < words; k++) {
        const float *tb = ptab + 128 * k;
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(pt + 16 * k + 8 * h));
            for (int n = 0; n < 8; n++) a[h] = _mm256_add_ps(a[h], lookup16(_mm256_srli_epi32(v, 4 * n), tb + 16 * n));
        }
    }
    _mm256_storeu_ps(out, a[0]);
    _mm256_storeu_ps(out + 8, a[1]);
}

/* the 4 bytes (8 nibbles) of one dword per lane of each plane, looked up in the tables at tk, into acc */
AI void lookup_dword8(const __m256i *G, const float *tk, __m256 *acc, const int bits) {
    for (int j = 0; j < bits; j++)
        for (int b = 0; b < 4; b++) {
            const __m256i g = b ? _mm256_srli_epi32(G[j], 8 * b) : G[j];
            acc[j] = _mm256_add_ps(acc[j], _mm256_add_ps(lookup16(g, tk + 32 * b),
                                                         lookup16(_mm256_srli_epi32(g, 4), tk + 32 * b + 16)));
        }
}

/* out[i] = sum_j w_j acc_j[i] for i < nr, the two's complement plane weights (the top plane -2^j) */
AI void store_planes8(const __m256 *acc, const int bits, int nr, float *out) {
    __m256 v = _mm256_setzero_ps();
    for (int j = 0; j < bits; j++) {
        const float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
        v = _mm256_fmadd_ps(acc[j], _mm256_set1_ps(w), v);
    }
    _mm256_maskstore_ps(out, lanes8(nr), v);
}

/* lane i: i * rowbytes, the offset of row i of an 8-row tile */
AI __m256i row_offsets8(int64_t rowbytes) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)rowbytes));
}

/* dword k of each of the nr <= 8 rows at p (row i at p + i * rowbytes) */
AI __m256i gather_rows8(const uint8_t *p, __m256i vidx, __m256i lanes) {
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)p, vidx, lanes, 1);
}

/* 8 bytes of each of the nr <= 8 rows at p, as two dword vectors (bytes 0-3 and 4-7 of every row): two qword
 * gathers (4 rows each) and four permutes, cheaper than two dword gathers (a gather costs about a load an element;
 * 834 -> 787 us for leech planes at 4096 x 4096 on a Zen 5 running the AVX2 build) */
AI void gather_pair8(const uint8_t *p, __m128i vlo, __m128i vhi, __m256i klo, __m256i khi, __m256i *g0, __m256i *g1) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i A = _mm256_permutevar8x32_epi32(
        _mm256_mask_i32gather_epi64(_mm256_setzero_si256(), (const long long *)p, vlo, klo, 1), order);
    const __m256i B = _mm256_permutevar8x32_epi32(
        _mm256_mask_i32gather_epi64(_mm256_setzero_si256(), (const long long *)p, vhi, khi, 1), order);
    *g0 = _mm256_permute2x128_si256(A, B, 0x20);
    *g1 = _mm256_permute2x128_si256(A, B, 0x31);
}

/* the next 8 rows' bytes [8 k, 8 (k + 4)) of each plane (one contiguous run a plane), a line every other step */
AI void tile8_prefetch(const uint8_t *p, int64_t rowbytes, int64_t plane_stride, int planes, int64_t k) {
    if ((8 * k) & 63) return;
    for (int j = 0; j < planes; j++) _mm_prefetch((const char *)(p + 8 * rowbytes + j * plane_stride + 8 * k), _MM_HINT_T0);
}

/* planes_tile_t on rows r0 .. r0 + nr - 1, nr <= 8 */
AI void planes_tile8_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                       const float *tab, float *out, const int bits) {
    const __m256i lanes = lanes8(nr);
    const __m256i vidx = row_offsets8(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m256 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm256_setzero_ps();
    const __m128i vlo = _mm256_castsi256_si128(vidx), vhi = _mm256_extracti128_si256(vidx, 1);
    const __m256i klo = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr), _mm256_setr_epi64x(0, 1, 2, 3));
    const __m256i khi = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr), _mm256_setr_epi64x(4, 5, 6, 7));
    int64_t k = 0;
    for (; k + 8 <= rowbytes; k += 8) {
        tile8_prefetch(p, rowbytes, plane_stride, bits, k);
        tile8_prefetch(p, rowbytes, plane_stride, bits, k + 4);
        __m256i G0[4], G1[4];
        for (int j = 0; j < bits; j++) gather_pair8(p + j * plane_stride + k, vlo, vhi, klo, khi, &G0[j], &G1[j]);
        lookup_dword8(G0, tab + 32 * k, acc, bits);
        lookup_dword8(G1, tab + 32 * (k + 4), acc, bits);
    }
    for (; k + 4 <= rowbytes; k += 4) {
        __m256i G[4];
        for (int j = 0; j < bits; j++) G[j] = gather_rows8(p + j * plane_stride + k, vidx, lanes);
        lookup_dword8(G, tab + 32 * k, acc, bits);
    }
    store_planes8(acc, bits, nr, out);
    planes_tail(p, plane_stride, rowbytes, k, nr, tab, out, bits);
}

/* onehot_tile_t on rows r0 .. r0 + nr - 1, nr <= 8 (pm: their spread parity, row i at pm + i * rowbytes) */
AI void onehot_tile8_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                       const uint8_t *pm, const float *tab, float *out, const int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __m256i lanes = lanes8(nr);
    const __m256i vidx = row_offsets8(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m256 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= rowbytes; k += 4) {
        tile8_prefetch(p, rowbytes, plane_stride, K + 1, k);
        __m256i M[6], V[4];
        for (int m = 0; m < K; m++) M[m] = gather_rows8(p + m * plane_stride + k, vidx, lanes);
        const __m256i S = gather_rows8(p + K * plane_stride + k, vidx, lanes);
        const __m256i P = gather_rows8(pm + k, vidx, lanes);
        ONEHOT_SLICE(__m256i, _mm256_setzero_si256(), M, P, S, V, K, nb);
        lookup_dword8(V, tab + 32 * k, acc, bits);
    }
    store_planes8(acc, bits, nr, out);
    onehot_tail(p, plane_stride, rowbytes, k, nr, pm, tab, out, K);
}

static void planes_tile8(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr,
                         const float *tab, float *out, int bits) {
    switch (bits) {
    case 4: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 4); break;
    case 3: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 3); break;
    case 2: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 2); break;
    default: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 1); break;
    }
}

static void onehot_tile8(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr,
                         const uint8_t *pm, const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tile8_t, base, stride, rowbytes, r0, nr, pm, tab, out);
}
#endif

/* the row's parity bits spread to one bit per coordinate (3 bytes a block), 8 blocks per table entry */
static uint8_t g_spread[256][24];

__attribute__((constructor)) static void init_spread(void) {
    for (int v = 0; v < 256; v++)
        for (int t = 0; t < 24; t++) g_spread[v][t] = ((v >> (t / 3)) & 1) ? 0xff : 0x00;
}

static void spread_parity(const uint8_t *par, int64_t parbytes, int64_t first, int64_t nblk, uint8_t *pmask) {
    int64_t b = 0;
    for (; b + 8 <= nblk; b += 8) memcpy(pmask + 3 * b, g_spread[get_bits(par, parbytes, (uint64_t)(first + b), 8)], 24);
    for (; b < nblk; b++) {
        uint8_t fill = parity_bit(par, first + b) ? 0xff : 0x00;
        pmask[3 * b] = pmask[3 * b + 1] = pmask[3 * b + 2] = fill;
    }
}

static int leech_init(Leech *L, int nstages, const uint8_t *const *streams, const int64_t *stream_bytes,
                      const int *layout, const int *param, const float *alpha, const uint16_t *scale, int64_t rows,
                      int64_t cols) {
    if (nstages < 1 || nstages > 2 || rows < 0 || cols < 24 || cols % 24) return -1;
    L->nstages = nstages;
    L->scale = scale;
    L->rows = rows;
    L->cols = cols;
    L->nblk = cols / 24;
    L->tiled[0] = L->tiled[1] = NULL;
    int64_t n = rows * L->nblk;
    for (int s = 0; s < nstages; s++) {
        L->stream[s] = streams[s];
        L->stream_bytes[s] = stream_bytes[s];
        L->layout[s] = layout[s];
        L->param[s] = param[s];
        L->alpha[s] = alpha[s];
        int planes = layout[s] == LEECH_PLANES ? param[s] : param[s] + 1;
        if ((layout[s] != LEECH_PLANES && layout[s] != LEECH_ONEHOT) || param[s] < 1 ||
            (layout[s] == LEECH_PLANES && param[s] > 4) || (layout[s] == LEECH_ONEHOT && param[s] > 6))
            return -1;
        if (stream_bytes[s] != planes * 3 * n + (n + 7) / 8) return -2;
    }
    return 0;
}

/* --------------------------------------------------------------- block floating point input (integer tiles) */
/* 2^k as a float (k in -149 .. 127), without a libm call for normal results */
static inline float pow2f(int k) {
    if (k < -126 || k > 127) return ldexpf(1.0f, k);
    union { uint32_t u; float f; } v = {(uint32_t)(k + 127) << 23};
    return v.f;
}

/* block floating point for a block whose largest magnitude is mx (finite): *fac = 2^(22 - e) and *unit = 2^(e - 22),
 * e the least with mx < 2^e, so that x * fac is exact and rounds to an integer below 2^22 in magnitude; 0 if a scale
 * is not a float (the callers then take their float paths) */
static inline int block_exponent(float mx, float *fac, float *unit) {
    int ex = 0;
    if (mx >= FLT_MIN) { /* mx = 0.1m * 2^(E - 126), E its biased exponent: frexpf's exponent */
        union { float f; uint32_t u; } v = {mx};
        ex = (int)((v.u >> 23) & 0xffu) - 126;
    } else if (mx > 0.0f) {
        frexpf(mx, &ex);
    }
    if (ex - 22 < -126 || ex - 22 > 127) return 0;
    *fac = pow2f(22 - ex);
    *unit = pow2f(ex - 22);
    return 1;
}

#if HAVE_AVX2
/* block_exponent for x[c0, c1) on AVX2; 0 also if an element is not finite */
static int block_scale8(const float *x, int64_t c0, int64_t c1, float *fac, float *unit) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t c = c0; c < c1; c += 8) {
        const __m256 v = _mm256_maskload_ps(x + c, lanes8(c1 - c));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, absmask));
    }
    float mx[8];
    _mm256_storeu_ps(mx, vmax);
    for (int i = 1; i < 8; i++) mx[0] = mx[i] > mx[0] ? mx[i] : mx[0];
    return !_mm256_movemask_ps(bad) && mx[0] <= FLT_MAX && block_exponent(mx[0], fac, unit);
}

/* the low bytes of the 8 int32 lanes of v to dst[0 .. 7] */
AI void store_low_bytes8(int8_t *dst, __m256i v) {
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, low_bytes),
                                                  _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(b));
}

/* columns c .. c + 7 of x (zero from c1 on) rounded to X = round(x fac) (nearest even, as lrintf), added to *vsum,
 * and split as X = 65536 X2 + 256 X1 + X0 into signed bytes (|X| < 2^22): the 8 bytes of Xp to out[p] + at */
AI void block_pieces8(const float *x, int64_t c, int64_t c1, __m256 fac, __m256i *vsum, int8_t *const out[3],
                      int64_t at) {
    const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_maskload_ps(x + c, lanes8(c1 - c)), fac));
    *vsum = _mm256_add_epi32(*vsum, X);
    const __m256i X0 = _mm256_srai_epi32(_mm256_slli_epi32(X, 24), 24);
    const __m256i R = _mm256_srai_epi32(_mm256_sub_epi32(X, X0), 8); /* exact: a multiple of 256 */
    const __m256i X1 = _mm256_srai_epi32(_mm256_slli_epi32(R, 24), 24);
    const __m256i P[3] = {X0, X1, _mm256_srai_epi32(_mm256_sub_epi32(R, X1), 8)};
    for (int p = 0; p < 3; p++) store_low_bytes8(out[p] + at, P[p]);
}

/* the sum of the 8 int32 lanes, in int64 */
static inline int64_t hsum8_epi32(__m256i v) {
    int32_t s[8];
    _mm256_storeu_si256((__m256i *)s, v);
    int64_t sum = 0;
    for (int i = 0; i < 8; i++) sum += s[i];
    return sum;
}
#endif

#if HAVE_VNNI
/* block_exponent for x[c0, c1); 0 also if an element is not finite */
static int block_scale(const float *x, int64_t c0, int64_t c1, __m512 *fac, float *unit) {
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t c = c0; c < c1; c += 16) {
        const __mmask16 m = c1 - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c1 - c)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
        bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    float f;
    if (bad || !isfinite(mx) || !block_exponent(mx, &f, unit)) return 0;
    *fac = _mm512_set1_ps(f);
    return 1;
}

/* columns c .. c + 15 of x (zero from c1 on) rounded to X = round(x fac), added to *vsum, and split as
 * X = 65536 X2 + 256 X1 + X0 into signed bytes: piece[p] = the 16 bytes Xp (|X| < 2^22) */
AI void block_pieces16(const float *x, int64_t c, int64_t c1, __m512 fac, __m512i *vsum, __m128i piece[3]) {
    const int64_t n = c1 - c >= 16 ? 16 : c1 - c;
    const __m512i X = _mm512_cvtps_epi32( /* round to nearest even, as lrintf */
        _mm512_mul_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), x + c), fac));
    *vsum = _mm512_add_epi32(*vsum, X);
    const __m512i X0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
    const __m512i R = _mm512_srai_epi32(_mm512_sub_epi32(X, X0), 8); /* exact: a multiple of 256 */
    const __m512i X1 = _mm512_srai_epi32(_mm512_slli_epi32(R, 24), 24);
    piece[0] = _mm512_cvtepi32_epi8(X0);
    piece[1] = _mm512_cvtepi32_epi8(X1);
    piece[2] = _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(R, X1), 8));
}
#endif

/* --------------------------------------------------------------------- Leech planes, 16-row tiles (GFNI + VNNI) */
/* A serving copy of a 4-plane `planes` stage, made once at load (accel/kernels/weights.py): the same plane bytes,
 * interleaved by 16 rows so that a tile is read with plain loads instead of gathers. Tile t (rows 16t .. 16t+15),
 * step s (coordinate bytes 2s and 2s+1 of a row: 16 coordinates), half h (rows 8h .. 8h+7): one qword per row, whose
 * byte 7 - (4 a + j) is plane j's byte 2s + a; 128 bytes a step, zero past a row's end and past the last row.
 *
 * gf2p8affineqb with that qword as its bit matrix and the bytes 1, 2, 4, ... 128 as its input transposes the 8 x 8
 * bits: output byte i holds coordinate i of byte 2s in its low nibble and of byte 2s + 1 in its high nibble, each
 * the 4-bit two's complement v of x = 2 v + p, and the instruction's constant 0x88 flips each nibble's top bit, so
 * the nibble is u = v + 8 in 0 .. 15. The lanes of a row are its two dwords (coordinates 0-3 and 4-7 of a byte), so
 * the input digits are broadcast by qword; otherwise the products are the affine tiles' (block floating point
 * input, three signed digit bytes, vpdpbusd), and sum_c v_c z_c = sum_c u_c z_c - 8 sum_c z_c per block, with the
 * block sums taken of the same rounded inputs. */

#if HAVE_VNNI && defined(__GFNI__)
#define HAVE_LEECH_TILES 1

AI void dpbusd_reg(__m512i *acc, __m512i q, __m512i x) { __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(q), "v"(x)); }

/* z (cols = 8 * rowbytes, zero padded to whole steps) as digit qwords xq[(2 s + a) * 3 + p] (coordinates 16 s + 8 a
 * .. + 7, piece p), per block of 128 coordinates unit[b] and zsum[b] (the sum of the rounded inputs); 0 if an element
 * is not finite */
static int leech_tiled_input(const float *z, int64_t cols, int64_t steps, int64_t *xq, float *unit, float *zsum) {
    const int64_t nblocks = (steps + 7) / 8;
    memset(xq, 0, (size_t)steps * 6 * sizeof(int64_t));
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t c0 = b * 128, c1 = c0 + 128 < cols ? c0 + 128 : cols;
        __m512 fac;
        if (!block_scale(z, c0, c1, &fac, &unit[b])) return 0;
        __m512i vsum = _mm512_setzero_si512();
        for (int64_t c = c0; c < c1; c += 16) {
            __m128i piece[3];
            block_pieces16(z, c, c1, fac, &vsum, piece);
            int64_t q[3][2];
            for (int p = 0; p < 3; p++) _mm_storeu_si128((__m128i *)q[p], piece[p]);
            int64_t *out = xq + (c / 16) * 6;
            for (int a = 0; a < 2; a++)
                for (int p = 0; p < 3; p++) out[a * 3 + p] = q[p][a];
        }
        zsum[b] = (float)((double)_mm512_reduce_add_epi32(vsum) * (double)unit[b]);
    }
    return 1;
}

/* out[i] = sum_c v_c z_c for the 16 rows of tile t of a tiled 4-plane stage */
static void leech_tiled_tile(const uint8_t *tiles, int64_t steps, int64_t t, const int64_t *xq, const float *unit,
                             const float *zsum, float *out) {
    const uint8_t *base = tiles + t * steps * 128;
    const __m512i E = _mm512_set1_epi64((long long)0x8040201008040201ull), nib = _mm512_set1_epi8(0x0f);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 total = _mm512_setzero_ps();
    const int64_t nblocks = (steps + 7) / 8, part = (nblocks + TILE_STREAMS - 1) / TILE_STREAMS;
    for (int64_t bi = 0; bi < part * TILE_STREAMS; bi++) { /* the parts of the tile in turn ("Streaming") */
        const int64_t b = (bi % TILE_STREAMS) * part + bi / TILE_STREAMS;
        if (b >= nblocks) continue;
        const int64_t k1 = b * 8 + 8 < steps ? b * 8 + 8 : steps;
        __m512i acc[12]; /* [half][low/high nibble][piece] */
        for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t k = b * 8; k < k1; k++) {
            prefetch_line(base + k * 128, steps * 128); /* and the next tile's line */
            prefetch_line(base + k * 128 + 64, steps * 128);
            const int64_t *xs = xq + k * 6;
            __m512i xl[3], xh[3];
            for (int p = 0; p < 3; p++) {
                xl[p] = _mm512_set1_epi64(xs[p]);
                xh[p] = _mm512_set1_epi64(xs[3 + p]);
            }
            for (int h = 0; h < 2; h++) {
                const __m512i w = _mm512_gf2p8affine_epi64_epi8(E, _mm512_loadu_si512(base + k * 128 + h * 64), 0x88);
                const __m512i lo = _mm512_and_si512(w, nib), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
                for (int p = 0; p < 3; p++) {
                    dpbusd_reg(&acc[h * 6 + p], lo, xl[p]);
                    dpbusd_reg(&acc[h * 6 + 3 + p], hi, xh[p]);
                }
            }
        }
        __m512 dot = _mm512_set1_ps(-8.0f * zsum[b]);
        const float mul[3] = {unit[b], 256.0f * unit[b], 65536.0f * unit[b]};
        for (int p = 0; p < 3; p++) { /* lanes 2r, 2r+1 of half h are row 8h + r */
            const __m512i s0 = _mm512_add_epi32(acc[p], acc[3 + p]), s1 = _mm512_add_epi32(acc[6 + p], acc[9 + p]);
            const __m512i s = _mm512_add_epi32(_mm512_permutex2var_epi32(s0, even, s1),
                                               _mm512_permutex2var_epi32(s0, odd, s1));
            dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(mul[p]), dot);
        }
        total = _mm512_add_ps(total, dot);
    }
    _mm512_storeu_ps(out, total);
}

#if defined(__AVX512VBMI__)
#define HAVE_ONEHOT_INT 1
/* Onehot tiles with integer products. The bit-sliced planes V[0..3] of a dword step (lane r: row r's 32 coordinates,
 * bit 8b + t of the dword = coordinate 8b + t) are rearranged by two rounds of vpermt2b into the planes tiles'
 * qwords (per row and byte pair s: byte 7 - (4a + j) = plane j's byte 2s + a), four registers of four rows each,
 * then decoded and multiplied as there (gf2p8affineqb transpose, u = v + 8 nibbles, vpdpbusd on the block floating
 * point z). A lane of those registers holds 4 coordinates of one row: lane L of register m is row 4m + L / 4, byte
 * pair (L / 2) % 2, coordinates 4 (L % 2) .. + 3 of its bytes; the input digits follow that pattern (xo, per step
 * [lo/hi nibble][piece][4 dwords], built once a call), and the lanes of a row are summed once per tile. */
static uint8_t g_oh_ix[2][64], g_oh_iy[2][64]; /* round 1: planes 0,1 (2,3) of rows 8h..8h+7; round 2: 4 rows */
__attribute__((constructor)) static void onehot_int_init(void) {
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 64; p++) /* X_h byte p: row 8h + p / 8, plane (p / 4) % 2, byte p % 4 */
            g_oh_ix[h][p] = (uint8_t)(((8 * h + p / 8) * 4 + p % 4) | ((p / 4) % 2 ? 64 : 0));
    for (int odd = 0; odd < 2; odd++)
        for (int q = 0; q < 64; q++) { /* O_m byte q: row 4m + q / 16 (4 odd + q / 16 within X, Y), pair (q / 8) % 2 */
            const int rr = 4 * odd + q / 16, pair = (q / 8) % 2, pos = q % 8, a = (7 - pos) / 4, j = (7 - pos) % 4;
            g_oh_iy[odd][q] = (uint8_t)(rr * 8 + (j % 2) * 4 + 2 * pair + a + (j >= 2 ? 64 : 0));
        }
}

/* xo[k][h][p] (4 dwords: the pattern of lanes 4i .. 4i + 3) from the planes tiles' input digits xq (bytes
 * B < 2 * tsteps; zero past them) */
static void onehot_int_input(const int64_t *xq, int64_t tsteps, int64_t osteps, int32_t *xo) {
    for (int64_t k = 0; k < osteps; k++)
        for (int h = 0; h < 2; h++) /* lo nibbles: bytes 4k, 4k + 2; hi: 4k + 1, 4k + 3 */
            for (int p = 0; p < 3; p++) {
                int32_t *o = xo + ((k * 2 + h) * 3 + p) * 4; /* the lane pattern repeats every 4 lanes */
                for (int l = 0; l < 4; l++) {
                    const int64_t B = 4 * k + 2 * ((l / 2) % 2) + h;
                    const int64_t q = B < 2 * tsteps ? xq[B * 3 + p] : 0;
                    o[l] = (int32_t)(l % 2 ? (uint64_t)q >> 32 : (uint64_t)q & 0xffffffffu);
                }
            }
}

AI void onehot_int_tile_t(const uint8_t *tile, int64_t steps, const uint32_t *pw, int64_t pwords, const int32_t *xo,
                          const float *unit, const float *zsum, float *out, const int K) {
    const int64_t ahead = steps * (K + 1) * 64; /* the next tile */
    const int nb = onehot_value_bits(K);
    const __m512i E = _mm512_set1_epi64((long long)0x8040201008040201ull);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i ix0 = _mm512_loadu_si512(g_oh_ix[0]), ix1 = _mm512_loadu_si512(g_oh_ix[1]);
    const __m512i iy0 = _mm512_loadu_si512(g_oh_iy[0]), iy1 = _mm512_loadu_si512(g_oh_iy[1]);
    __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    float corr = 0.0f;
    const int64_t nblocks = (steps + 3) / 4, part = (nblocks + TILE_STREAMS - 1) / TILE_STREAMS;
    for (int64_t bi = 0; bi < part * TILE_STREAMS; bi++) { /* blocks of 4 steps (128 coordinates), parts in turn */
        const int64_t b = (bi % TILE_STREAMS) * part + bi / TILE_STREAMS, k1 = 4 * b + 4 < steps ? 4 * b + 4 : steps;
        if (b >= nblocks) continue;
        __m512i acc[12]; /* [m][piece] */
        for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t k = 4 * b; k < k1; k++) {
            __m512i V[4];
            onehot_tiled_step(tile, k, ahead, pw, pwords, V, K);
            for (int j = nb + 1; j < 4; j++) V[j] = V[nb]; /* sign-extend v to 4 bits */
            const __m512i X[2] = {_mm512_permutex2var_epi8(V[0], ix0, V[1]), _mm512_permutex2var_epi8(V[0], ix1, V[1])};
            const __m512i Y[2] = {_mm512_permutex2var_epi8(V[2], ix0, V[3]), _mm512_permutex2var_epi8(V[2], ix1, V[3])};
            const int32_t *xs = xo + k * 24;
            __m512i xd[6]; /* [lo/hi][piece] */
            for (int i = 0; i < 6; i++) xd[i] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xs + 4 * i)));
            for (int m = 0; m < 4; m++) {
                const __m512i O = _mm512_permutex2var_epi8(X[m / 2], m % 2 ? iy1 : iy0, Y[m / 2]);
                const __m512i wv = _mm512_gf2p8affine_epi64_epi8(E, O, 0x88);
                const __m512i lo = _mm512_and_si512(wv, nib), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
                for (int p = 0; p < 3; p++) {
                    dpbusd_reg(&acc[m * 3 + p], lo, xd[p]);
                    dpbusd_reg(&acc[m * 3 + p], hi, xd[3 + p]);
                }
            }
        }
        const __m512 mul0 = _mm512_set1_ps(unit[b]), mul1 = _mm512_set1_ps(256.0f * unit[b]),
                     mul2 = _mm512_set1_ps(65536.0f * unit[b]);
        for (int m = 0; m < 4; m++) {
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m * 3 + 2]), mul2);
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m * 3 + 1]), mul1, f);
            total[m] = _mm512_add_ps(total[m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m * 3]), mul0, f));
        }
        corr -= 8.0f * zsum[b]; /* sum v z = sum u z - 8 sum z */
    }
    float lanes[4][16];
    for (int m = 0; m < 4; m++) _mm512_storeu_ps(lanes[m], total[m]);
    for (int r = 0; r < 16; r++) {
        const float *l = lanes[r / 4] + 4 * (r % 4);
        out[r] = ((l[0] + l[1]) + (l[2] + l[3])) + corr;
    }
}

static void onehot_int_tile(const uint8_t *tile, int64_t steps, const uint32_t *pw, int64_t pwords,
                            const int32_t *xo, const float *unit, const float *zsum, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_int_tile_t, tile, steps, pw, pwords, xo, unit, zsum, out);
}
#else
#define HAVE_ONEHOT_INT 0
#endif
#else
#define HAVE_LEECH_TILES 0
#define HAVE_ONEHOT_INT 0
#endif

/* ------------------------------------------------------------ Leech planes, 16-row tiles on AVX2 (byte tables) */
/* Without AVX-512 there is no gf2p8affineqb to turn a row's four plane bytes into nibbles, and the bit-by-bit
 * transpose costs more than the products. So the AVX2 kernel reads the same tile copy and looks the planes up
 * instead, as the row kernels do, but in bytes (32 lookups a vpshufb, against 8 floats a vpermps):
 * - z is rounded per block of 128 coordinates to X = round(z fac), |X| <= 2^22 * 15 / 128 = 491520 (the VNNI tiles'
 *   block scale times 15 / 128), and written as four balanced base-32 digits, X = sum_p 32^p d_p, d_0..d_2 in
 *   [-16, 15] and d_3 in [-15, 15];
 * - per coordinate nibble (4 coordinates of a plane byte) and digit p, a 16-entry byte table holds the subset sums
 *   of the 4 coordinates' d_p (built once a call): a lookup is one vpshufb for 32 (row, plane) bytes, and the two
 *   nibbles of a byte add in int8 (8 digits: [-128, 120]);
 * - the top plane is stored complemented (u = v + 8 has the top bit flipped, sum v z = sum u z - 8 sum z, with the
 *   block sums of the rounded z), so the plane weights 8, 4, 2, 1 are unsigned and vpmaddubsw applies them to the
 *   signed sums and adds plane pairs into 16-bit lanes; a block's 8 steps stay below 2^15 (|8 a + 4 b| <= 12 * 128
 *   a byte pair, two of them a step and accumulator); vpmaddwd by ones sums a row's two lanes once a block.
 * This build's tile copy is laid out for these loads (accel_leech_planes_lane_order, weights._planes_tiles): a
 * step's half-tile is A (32 bytes: byte 2s of planes 3..0 a dword, rows 0,4,1,5 | 2,6,3,7) then B (byte 2s + 1),
 * so every 128-bit lane of A or B reads one table as loaded (docs/kernels.md, "AVX2 Leech tiles"). */
#if HAVE_AVX2
#define HAVE_LEECH_LUT 1
/* digits of 5 bits, so that every digit's nibble sums add in int8 and one 16-bit sum a digit holds a block (a 6-bit
 * top digit, |X| < 2^20, took a product a nibble and a second sum, measured no faster; 5 digits, |X| < 2^22: measured
 * 1.14x slower) */
#define LUT_PIECES 4

/* the 16-byte tables tabs[((s * LUT_PIECES + p) * 4 + 2 a + h) * 16 + n] (step s, plane byte 2s + a, nibble h,
 * digit p) and per block of 8 steps unit[b] and zsum[b] = unit * sum X; 0 if an element is not finite */
static int leech_lut_input(const float *z, int64_t cols, int64_t steps, int8_t *tabs, float *unit, float *zsum) {
    const int64_t nblocks = (steps + 7) / 8;
    __m256i pick[4], bit[4]; /* lane 0 broadcasts digit t of the low nibble, lane 1 of the high one */
    for (int t = 0; t < 4; t++) {
        pick[t] = _mm256_setr_m128i(_mm_set1_epi8((char)t), _mm_set1_epi8((char)(4 + t)));
        int8_t m[16];
        for (int n = 0; n < 16; n++) m[n] = (int8_t)((n >> t) & 1 ? -1 : 0);
        const __m128i mm = _mm_loadu_si128((const __m128i *)m);
        bit[t] = _mm256_setr_m128i(mm, mm);
    }
    const __m256i sixteen = _mm256_set1_epi32(16), low5 = _mm256_set1_epi32(31);
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t c0 = b * 128, c1 = c0 + 128 < cols ? c0 + 128 : cols;
        float fac;
        if (!block_scale8(z, c0, c1, &fac, &unit[b])) return 0;
        fac *= 15.0f / 128.0f; /* exact: fac is a power of two of at least 2^-107; |X| <= 491520 = 15 * 32768, so
                                * d_3 = (X - d_0 - 32 d_1 - 1024 d_2) / 32768 is within 15 + 16 * 1057 / 32768 */
        unit[b] = 1.0f / fac;
        int8_t d[LUT_PIECES][128]; /* the block's digits, zero past the columns */
        __m256i vsum = _mm256_setzero_si256();
        for (int i = 0; i < 128; i += 8) {
            const int64_t c = c0 + i;
            const __m256 v = c < c1 ? _mm256_maskload_ps(z + c, lanes8(c1 - c)) : _mm256_setzero_ps();
            __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(fac))); /* nearest even, as lrintf */
            vsum = _mm256_add_epi32(vsum, X);
            for (int p = 0; p < LUT_PIECES; p++) { /* d = ((X + 16) mod 32) - 16, X = (X - d) / 32 (exact); d_3 = X */
                const __m256i dp = p == LUT_PIECES - 1
                                       ? X
                                       : _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X, sixteen), low5), sixteen);
                X = _mm256_srai_epi32(_mm256_sub_epi32(X, dp), 5);
                store_low_bytes8(d[p] + i, dp);
            }
        }
        zsum[b] = (float)((double)hsum8_epi32(vsum) * (double)unit[b]);
        for (int64_t cb = 0; cb < 16 && 16 * b + cb < 2 * steps; cb++) { /* plane byte 16 b + cb: 8 coordinates */
            const int64_t B = 16 * b + cb, s = B / 2, a = B % 2;
            for (int p = 0; p < LUT_PIECES; p++) {
                int64_t eight; /* the plane byte's 8 digits */
                memcpy(&eight, d[p] + 8 * cb, sizeof eight);
                const __m256i R = _mm256_set1_epi64x(eight);
                __m256i T = _mm256_and_si256(_mm256_shuffle_epi8(R, pick[0]), bit[0]);
                for (int t = 1; t < 4; t++) T = _mm256_add_epi8(T, _mm256_and_si256(_mm256_shuffle_epi8(R, pick[t]), bit[t]));
                _mm256_storeu_si256((__m256i *)(tabs + ((s * LUT_PIECES + p) * 4 + 2 * a) * 16), T);
            }
        }
    }
    return 1;
}

/* n registers of 32 (row, plane) bytes, each of one plane byte per 128-bit lane (lo[i], hi[i]: their nibbles),
 * looked up in that byte's tables t (digit p at t + 64 p, the high nibble's 16 bytes on), each table loaded once for
 * the n, into the 16-bit sums acc[i][p] */
AI void lut_bytes(const __m256i *lo, const __m256i *hi, const int n, const int8_t *t, __m256i (*acc)[LUT_PIECES]) {
    const __m256i w = _mm256_set1_epi32(0x01020408); /* bytes: planes 3, 2, 1, 0 */
    for (int p = 0; p < LUT_PIECES; p++) {
        const __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 64 * p)));
        const __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 64 * p + 16)));
        for (int i = 0; i < n; i++) /* the byte's two nibbles add in int8 */
            maddubs_add(&acc[i][p], w, _mm256_add_epi8(_mm256_shuffle_epi8(tl, lo[i]), _mm256_shuffle_epi8(th, hi[i])));
    }
}

AI __m256i lut_low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
AI __m256i lut_high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }

/* a block's 16-bit sums of 8 rows as float row sums * unit */
AI __m256 lut_block_dot(const __m256i acc[LUT_PIECES], float unit) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[LUT_PIECES];
    for (int p = 0; p < LUT_PIECES; p++) s[p] = _mm256_madd_epi16(acc[p], ones);
    /* sum_p 32^p s_p, exact in int32: |s_p| <= 128 * 15 * 16, so |sum| < 2^31 */
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(s[0], _mm256_slli_epi32(s[1], 5)),
                                         _mm256_add_epi32(_mm256_slli_epi32(s[2], 10), _mm256_slli_epi32(s[3], 15)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(unit));
}

/* a step's 16 rows into the 16-bit sums acc[h] of its halves (h: rows 8h .. 8h+7), each half A then B as they are
 * used; both halves at once, so each table is loaded once for the two */
AI void leech_lut_step(const uint8_t *q, const int8_t *tk, __m256i acc[2][LUT_PIECES]) {
    for (int a = 0; a < 2; a++) { /* A, then B */
        const __m256i v[2] = {_mm256_loadu_si256((const __m256i *)(q + 32 * a)),
                              _mm256_loadu_si256((const __m256i *)(q + 64 + 32 * a))};
        const __m256i lo[2] = {lut_low_nibbles(v[0]), lut_low_nibbles(v[1])};
        const __m256i hi[2] = {lut_high_nibbles(v[0]), lut_high_nibbles(v[1])};
        lut_bytes(lo, hi, 2, tk + 32 * a, acc);
    }
}

/* out[i] = sum_c v_c z_c for the 16 rows of tile t of a tiled 4-plane stage */
static void leech_lut_tile(const uint8_t *tiles, int64_t steps, int64_t t, const int8_t *tabs, const float *unit,
                           const float *zsum, float *out) {
    const uint8_t *base = tiles + t * steps * 128;
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr = 0.0f;
    const int64_t nblocks = (steps + 7) / 8, part = (nblocks + TILE_STREAMS - 1) / TILE_STREAMS;
    for (int64_t bi = 0; bi < part * TILE_STREAMS; bi++) { /* the parts of the tile in turn ("Streaming") */
        const int64_t b = (bi % TILE_STREAMS) * part + bi / TILE_STREAMS;
        if (b >= nblocks) continue;
        const int64_t k1 = b * 8 + 8 < steps ? b * 8 + 8 : steps;
        __m256i acc[2][LUT_PIECES];
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < LUT_PIECES; p++) acc[h][p] = _mm256_setzero_si256();
        for (int64_t k = b * 8; k < k1; k++) {
            prefetch_line(base + k * 128, steps * 128); /* and the next tile's line */
            prefetch_line(base + k * 128 + 64, steps * 128);
            leech_lut_step(base + k * 128, tabs + k * LUT_PIECES * 64, acc);
        }
        for (int h = 0; h < 2; h++) total[h] = _mm256_add_ps(total[h], lut_block_dot(acc[h], unit[b]));
        corr -= 8.0f * zsum[b]; /* sum v z = sum u z - 8 sum z */
    }
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(_mm256_permutevar8x32_ps(total[h], order), _mm256_set1_ps(corr)));
}

/* Onehot stages on AVX2: the tile copy's step k (32 coordinates of 16 rows: per plane 16 rows x 4 bytes) half by
 * half, bit-sliced into the planes of v as in onehot_tiled_step (sign-extended to 4 planes; spread_parity8), then a
 * 4 x 4 byte transpose per row (one vpshufb a plane, two rounds of unpacks) gives four registers of one plane byte
 * each, rows 0-3 | 4-7 with their planes 3..0 in a dword, looked up as the 4-plane tiles are. */
AI void onehot_lut_step(const uint8_t *tile, int64_t k, int h, int64_t ahead, const uint32_t *pw, int64_t pwords,
                        const int8_t *tk, __m256i acc[1][LUT_PIECES], const int K) {
    const int nb = onehot_value_bits(K);
    const uint8_t *q = tile + k * (K + 1) * 64 + 32 * h;
    if (!h)
        for (int m = 0; m <= K; m++) prefetch_line(q + m * 64, ahead);
    __m256i M[6], V[4];
    for (int m = 0; m < K; m++) M[m] = _mm256_loadu_si256((const __m256i *)(q + m * 64));
    const __m256i S = _mm256_loadu_si256((const __m256i *)(q + K * 64));
    const __m256i P = (__m256i)spread_parity8(pw, pwords, k, 8 * h);
    ONEHOT_SLICE(__m256i, _mm256_setzero_si256(), M, P, S, V, K, nb);
    for (int j = nb + 1; j < 4; j++) V[j] = V[nb]; /* sign-extend v to 4 bits */
    V[3] = _mm256_xor_si256(V[3], _mm256_set1_epi8(-1)); /* u = v + 8 */
    const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m256i T[4]; /* per lane: dword b = byte b of the lane's 4 rows */
    for (int j = 0; j < 4; j++) T[j] = _mm256_shuffle_epi8(V[j], tr);
    const __m256i t32 = _mm256_unpacklo_epi8(T[3], T[2]), t10 = _mm256_unpacklo_epi8(T[1], T[0]);
    const __m256i u32 = _mm256_unpackhi_epi8(T[3], T[2]), u10 = _mm256_unpackhi_epi8(T[1], T[0]);
    const __m256i C[4] = {_mm256_unpacklo_epi16(t32, t10), _mm256_unpackhi_epi16(t32, t10),
                          _mm256_unpacklo_epi16(u32, u10), _mm256_unpackhi_epi16(u32, u10)};
    for (int b = 0; b < 4; b++) { /* plane byte 4k + b: tables of step 2k + b / 2, byte b % 2 */
        const __m256i lo = lut_low_nibbles(C[b]), hi = lut_high_nibbles(C[b]);
        lut_bytes(&lo, &hi, 1, tk + (b / 2) * LUT_PIECES * 64 + (b % 2) * 32, acc);
    }
}

/* out[i] = sum_c v_c z_c for the 16 rows of a onehot tile (steps of 32 coordinates; pw: its parity words) */
AI void onehot_lut_tile_t(const uint8_t *tile, int64_t steps, const uint32_t *pw, int64_t pwords, const int8_t *tabs,
                          const float *unit, const float *zsum, float *out, const int K) {
    const int64_t ahead = steps * (K + 1) * 64; /* the next tile */
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr = 0.0f;
    const int64_t nblocks = (steps + 3) / 4, part = (nblocks + TILE_STREAMS - 1) / TILE_STREAMS;
    for (int64_t bi = 0; bi < part * TILE_STREAMS; bi++) { /* blocks of 4 steps (128 coordinates), parts in turn */
        const int64_t b = (bi % TILE_STREAMS) * part + bi / TILE_STREAMS, k1 = 4 * b + 4 < steps ? 4 * b + 4 : steps;
        if (b >= nblocks) continue;
        for (int h = 0; h < 2; h++) {
            __m256i acc[1][LUT_PIECES];
            for (int p = 0; p < LUT_PIECES; p++) acc[0][p] = _mm256_setzero_si256();
            for (int64_t k = 4 * b; k < k1; k++)
                onehot_lut_step(tile, k, h, ahead, pw, pwords, tabs + 2 * k * LUT_PIECES * 64, acc, K);
            total[h] = _mm256_add_ps(total[h], lut_block_dot(acc[0], unit[b]));
        }
        corr -= 8.0f * zsum[b]; /* sum v z = sum u z - 8 sum z */
    }
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(total[h], _mm256_set1_ps(corr)));
}

static void onehot_lut_tile(const uint8_t *tile, int64_t steps, const uint32_t *pw, int64_t pwords, const int8_t *tabs,
                            const float *unit, const float *zsum, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_lut_tile_t, tile, steps, pw, pwords, tabs, unit, zsum, out);
}
#else
#define HAVE_LEECH_LUT 0
#endif


/* the Leech kernels read tile copies of 4-plane and onehot stages (AVX-512 VNNI + GFNI, or AVX2) */
API int accel_leech_tiles_available(void) { return (HAVE_LEECH_TILES || HAVE_LEECH_LUT) && g_simd; }
/* how this build's 4-plane tile copy orders a half-step: 0 a qword a row (AVX-512), 1 A then B with the top plane
 * complemented (AVX2, leech_lut_step) */
API int accel_leech_planes_lane_order(void) { return HAVE_LEECH_LUT; }

/* t[r] = scale[r] * sum_s alpha_s <x_s[r], z> for rows [0, rows), in tiles of 16 rows */
static void leech_rows(const Leech *L, const float *z, const float *zb, float *t, int nthreads) {
    const int64_t n = L->rows * L->nblk, plane = 3 * n, rowbytes = 3 * L->nblk, parbytes = (n + 7) / 8;
    const int64_t tiles = (L->rows + 15) / 16;
    float *tab = NULL;
    int need_tab = 1; /* the lookup tables: for every stage that the integer tile kernel does not take */
    const int64_t tsteps = (rowbytes + 1) / 2; /* of a 4-plane tile copy */
#if HAVE_LEECH_TILES
    int64_t *xq = NULL;
    float *tunit = NULL;
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        xq = xalloc((size_t)tsteps * 6 * sizeof(int64_t));
        tunit = xalloc((size_t)((tsteps + 7) / 8) * 2 * sizeof(float));
        if (!leech_tiled_input(z, L->cols, tsteps, xq, tunit, tunit + (tsteps + 7) / 8)) { /* the float path */
            free(xq);
            xq = NULL;
        }
    }
    int32_t *xo = NULL; /* onehot tiles' input digits */
    if (xq) {
        need_tab = 0;
        for (int s = 0; s < L->nstages; s++)
            need_tab |= !L->tiled[s] || (L->layout[s] == LEECH_ONEHOT && !HAVE_ONEHOT_INT);
#if HAVE_ONEHOT_INT
        for (int s = 0; s < L->nstages; s++)
            if (L->tiled[s] && L->layout[s] == LEECH_ONEHOT && !xo) {
                xo = xalloc((size_t)((rowbytes + 3) / 4) * 24 * sizeof(int32_t));
                onehot_int_input(xq, tsteps, (rowbytes + 3) / 4, xo);
            }
#endif
    }
#endif
#if HAVE_LEECH_LUT
    int8_t *ltab = NULL; /* the AVX2 tiles' byte tables, then per block unit and zsum */
    float *lunit = NULL;
    const int64_t lsteps = 2 * ((rowbytes + 3) / 4), lblocks = (lsteps + 7) / 8; /* >= tsteps; onehot steps */
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        ltab = xalloc((size_t)lsteps * LUT_PIECES * 64);
        lunit = xalloc((size_t)lblocks * 2 * sizeof(float));
        if (leech_lut_input(z, L->cols, lsteps, ltab, lunit, lunit + lblocks)) {
            need_tab = 0;
            for (int s = 0; s < L->nstages; s++) need_tab |= !L->tiled[s];
        } else { /* a non-finite input: the float path */
            free(ltab);
            ltab = NULL;
        }
    }
#endif
    float *ptab = NULL; /* parity tables for the tile copies' parity words */
    const int64_t pwords = (L->nblk + 31) / 32;
#if HAVE_AVX512 || HAVE_AVX2
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        float *zbp = xalloc((size_t)pwords * 32 * sizeof(float));
        memset(zbp, 0, (size_t)pwords * 32 * sizeof(float));
        memcpy(zbp, zb, (size_t)L->nblk * sizeof(float));
        ptab = xalloc((size_t)pwords * 128 * sizeof(float));
        build_tables(zbp, pwords * 32, ptab);
        free(zbp);
    }
#endif
    if (need_tab) { /* padded to whole dwords of a row (zero): the onehot tile copies read them */
        tab = xalloc((size_t)(L->cols + 32) * 4 * sizeof(float));
        memset(tab, 0, (size_t)(L->cols + 32) * 4 * sizeof(float));
        build_tables(z, L->cols, tab);
    }
    int tile_kernels = HAVE_AVX512; /* the tile copies are read (else the stored streams): AVX2 needs the tables */
#if HAVE_LEECH_LUT
    tile_kernels = ltab != NULL;
#endif
    int nt = threads_for(nthreads, (double)L->rows * L->cols);
#pragma omp parallel num_threads(nt)
    {
        uint8_t *pm = xalloc((size_t)(16 * rowbytes + 64));
        memset(pm, 0, (size_t)(16 * rowbytes + 64));
        float vals[16];
#pragma omp for schedule(guided, 2) /* runs of tiles: the prefetched next tile is mostly this thread's */
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t r0 = tile * 16;
            const int nr = L->rows - r0 < 16 ? (int)(L->rows - r0) : 16;
            float total[16] = {0};
            for (int s = 0; s < L->nstages; s++) {
                const uint8_t *base = L->stream[s];
                const int onehot = L->layout[s] == LEECH_ONEHOT;
                const uint8_t *par = base + (onehot ? L->param[s] + 1 : L->param[s]) * plane;
                const int64_t tbytes = onehot ? ((rowbytes + 3) / 4) * (L->param[s] + 1) * 64 : tsteps * 128;
                /* the tile's parity words, after the tiles (unread by the scalar build) */
                __attribute__((unused)) const uint32_t *pw =
                    L->tiled[s] ? (const uint32_t *)(L->tiled[s] + tiles * tbytes) + tile * pwords * 16 : NULL;
                if (onehot && !(g_simd && L->tiled[s] && tile_kernels))
                    for (int i = 0; i < nr; i++)
                        spread_parity(par, parbytes, (r0 + i) * L->nblk, L->nblk, pm + i * rowbytes);
#if HAVE_AVX512
                if (g_simd) {
#if HAVE_LEECH_TILES
                    if (xq && L->tiled[s] && !onehot)
                        leech_tiled_tile(L->tiled[s], tsteps, tile, xq, tunit, tunit + (tsteps + 7) / 8, vals);
                    else
#endif
#if HAVE_ONEHOT_INT
                    if (xo && onehot && L->tiled[s])
                        onehot_int_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, pw, pwords, xo, tunit,
                                        tunit + (tsteps + 7) / 8, vals, L->param[s]);
                    else
#endif
                    if (onehot && L->tiled[s])
                        onehot_tiled_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, nr, pw, pwords, tab, vals,
                                          L->param[s]);
                    else if (onehot) onehot_tile(base, plane, rowbytes, r0, nr, pm, tab, vals, L->param[s]);
                    else planes_tile(base, plane, rowbytes, r0, nr, tab, vals, L->param[s]);
                } else
#elif HAVE_AVX2
                if (g_simd) {
#if HAVE_LEECH_LUT
                    if (ltab && L->tiled[s] && !onehot)
                        leech_lut_tile(L->tiled[s], tsteps, tile, ltab, lunit, lunit + lblocks, vals);
                    else if (ltab && L->tiled[s])
                        onehot_lut_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, pw, pwords, ltab, lunit,
                                        lunit + lblocks, vals, L->param[s]);
                    else
#endif
                    for (int h = 0; h < nr; h += 8) { /* the tile in two halves of 8 rows */
                        const int nh = nr - h < 8 ? nr - h : 8;
                        if (onehot) onehot_tile8(base, plane, rowbytes, r0 + h, nh, pm + h * rowbytes, tab, vals + h,
                                                 L->param[s]);
                        else planes_tile8(base, plane, rowbytes, r0 + h, nh, tab, vals + h, L->param[s]);
                    }
                } else
#endif
                { /* scalar: the same table lookups, a byte of a row at a time (with the parity term's branch removed,
                   * 19.5x / 6.8x faster on planes / onehot at 4096 x 4096 than the bit-by-bit sums they replaced) */
                    const uint8_t *p = base + r0 * rowbytes;
                    for (int i = 0; i < nr; i++) vals[i] = 0.0f;
                    if (onehot) onehot_tail(p, plane, rowbytes, 0, nr, pm, tab, vals, L->param[s]);
                    else planes_tail(p, plane, rowbytes, 0, nr, tab, vals, L->param[s]);
                }
                float pv[16]; /* x = 2 v + p: the parity term from the tile copy's parity words, or from the stream */
#if HAVE_AVX512 || HAVE_AVX2
                if (g_simd && pw) parity_tiled(pw, pwords, ptab, pv);
                else
#endif
                    for (int i = 0; i < nr; i++) pv[i] = parity_term(par, parbytes, (r0 + i) * L->nblk, L->nblk, zb);
                for (int i = 0; i < nr; i++) total[i] += L->alpha[s] * (2.0f * vals[i] + pv[i]);
            }
            for (int i = 0; i < nr; i++) t[r0 + i] = half_to_float(L->scale[r0 + i]) * total[i];
        }
        free(pm);
    }
    free(tab);
    free(ptab);
#if HAVE_LEECH_TILES
    free(xq);
    free(tunit);
    free(xo);
#endif
#if HAVE_LEECH_LUT
    free(ltab);
    free(lunit);
#endif
}

/* y = U^T T V x: V as (sign, R, odd size), U as (sign, R^T, odd size); x has in_features <= cols entries (zero padded) */
API int accel_leech_matvec(int nstages, const uint8_t *const *streams, const int64_t *stream_bytes, const int *layout,
                           const int *param, const float *alpha, const uint16_t *scale, const uint8_t *const *tiled,
                           int64_t rows, int64_t cols,
                           int64_t in_features, const float *sign_in, const float *rot_in, int64_t odd_in,
                           const float *sign_out, const float *rot_out_t, int64_t odd_out, const float *x, float *y,
                           int nthreads) {
    Leech L;
    int err = leech_init(&L, nstages, streams, stream_bytes, layout, param, alpha, scale, rows, cols);
    if (err) return err;
    for (int s = 0; s < nstages && tiled; s++) /* tile copies of 4-plane and onehot stages */
        L.tiled[s] = (layout[s] == LEECH_PLANES && param[s] == 4) || layout[s] == LEECH_ONEHOT ? tiled[s] : NULL;
    if (in_features > cols || in_features < 1 || odd_in < 1 || cols % odd_in || odd_out < 1 || rows % odd_out)
        return -1;
    int64_t big = cols > rows ? cols : rows;
    float *z = xalloc((size_t)(cols + 16) * sizeof(float));
    float *tmp = xalloc((size_t)(big + 16) * sizeof(float));
    float *zb = xalloc((size_t)(L.nblk + 16) * sizeof(float));
    memcpy(z, x, (size_t)in_features * sizeof(float));
    memset(z + in_features, 0, (size_t)(cols - in_features) * sizeof(float));
    g_rht_threads = nthreads > 0 ? nthreads : omp_get_max_threads();
    rht_one(z, cols, sign_in, rot_in, odd_in, 0, tmp);
    for (int64_t b = 0; b < L.nblk; b++) {
        float s = 0.0f;
        for (int i = 0; i < 24; i++) s += z[24 * b + i];
        zb[b] = s;
    }
    leech_rows(&L, z, zb, y, nthreads);
    rht_one(y, rows, sign_out, rot_out_t, odd_out, 1, tmp);
    g_rht_threads = 1;
    free(z);
    free(tmp);
    free(zb);
    return 0;
}

/* o[t] += alpha * x_t for the 8 coordinates of one byte position: x = 2 v + p, v in `bits`-bit two's complement
 * (the top bit weighs -2^(bits-1)) with bit j of v in bit t of V[j] */
static inline __attribute__((always_inline)) void add_coords8(float *o, const unsigned *V, int p, float alpha,
                                                              const int bits) {
    for (int t = 0; t < 8; t++) {
        int v = 0;
        for (int j = 0; j < bits; j++) v += (int)((V[j] >> t) & 1u) << j;
        v -= (int)((V[bits - 1] >> t) & 1u) << bits;
        o[t] += alpha * (float)(2 * v + p);
    }
}

/* rows [r0, r1) of T = scale * sum_s alpha_s x_s (the transformed weight, cols wide) */
API int accel_leech_decode_rows(int nstages, const uint8_t *const *streams, const int64_t *stream_bytes,
                                const int *layout, const int *param, const float *alpha, const uint16_t *scale,
                                int64_t rows, int64_t cols, int64_t r0, int64_t r1, float *out, int nthreads) {
    Leech L;
    int err = leech_init(&L, nstages, streams, stream_bytes, layout, param, alpha, scale, rows, cols);
    if (err) return err;
    if (r0 < 0 || r1 > rows || r0 > r1) return -1;
    const int64_t n = rows * L.nblk, plane = 3 * n, rowbytes = 3 * L.nblk;
    int nt = threads_for(nthreads, (double)(r1 - r0) * cols);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 8)
    for (int64_t r = r0; r < r1; r++) {
        float *o = out + (r - r0) * cols;
        float s = half_to_float(scale[r]);
        for (int64_t c = 0; c < cols; c++) o[c] = 0.0f;
        for (int st = 0; st < nstages; st++) {
            const uint8_t *base = L.stream[st] + r * rowbytes;
            const int onehot = L.layout[st] == LEECH_ONEHOT, K = L.param[st];
            const uint8_t *par = L.stream[st] + (onehot ? K + 1 : K) * plane;
            const int nb = onehot ? (K + 1 >= 4 ? 3 : (K + 1 >= 2 ? 2 : 1)) : 0, bits = onehot ? nb + 1 : K;
            for (int64_t kb = 0; kb < rowbytes; kb++) { /* 8 coordinates, all in block kb / 3 */
                const int p = parity_bit(par, r * L.nblk + kb / 3);
                unsigned V[4];
                if (onehot) {
                    unsigned M[6], S = base[K * plane + kb], P = p ? 0xffu : 0u;
                    for (int m = 0; m < K; m++) M[m] = base[m * plane + kb];
                    ONEHOT_SLICE(unsigned, 0u, M, P, S, V, K, nb);
                } else {
                    for (int j = 0; j < bits; j++) V[j] = base[j * plane + kb];
                }
                switch (bits) { /* constant widths unroll and vectorize */
                case 4: add_coords8(o + 8 * kb, V, p, L.alpha[st], 4); break;
                case 3: add_coords8(o + 8 * kb, V, p, L.alpha[st], 3); break;
                case 2: add_coords8(o + 8 * kb, V, p, L.alpha[st], 2); break;
                default: add_coords8(o + 8 * kb, V, p, L.alpha[st], 1); break; /* leech_init: 1 <= bits <= 4 */
                }
            }
        }
        for (int64_t c = 0; c < cols; c++) o[c] *= s;
    }
    return 0;
}

/* ------------------------------------------------------------------------------ affine, 16-row tiles (VNNI) */
/* A serving copy of `packed` 8-, 4- and 2-bit codes, made once at load (accel/kernels/weights.py), for integer dot
 * products. Tile t holds rows 16t .. 16t+15 as `steps` steps of 64 bytes; step k holds bytes 4k .. 4k+3 of each
 * of the 16 rows' code streams, row after row (tile[t][k][lane][4]). Rows past the last and bytes past a row's end
 * are zero. Scales (and offsets) are stored [t][g][16] in their stored dtype, zero past the last row. A group is a
 * whole number of steps (group % (4 * codes per byte) == 0), or a row is one group.
 *
 * Each call writes the input once as block floating point, in blocks of at most 128 columns that divide the group:
 * X = round(x 2^e_b) with |X| < 2^22, split into three signed bytes X = 65536 X2 + 256 X1 + X0. vpdpbusd
 * multiplies 4 unsigned code bytes by 4 signed digit bytes and adds them to an int32 lane (64 products an
 * instruction, two instructions a cycle on this CPU); a lane is a row, so each block's three exact int32 sums are
 * converted and scaled once, for 16 rows at once. Besides float32 accumulation, the only rounding is the input's:
 * |x - X 2^-e_b| <= 2^-23 max |x| over the block. An input with a non-finite element takes the float path, so NaN
 * and Inf propagate as in a float dot product. */


typedef struct {
    const uint8_t *tiles;
    int bits, levels, symmetric, scale_f32;
    const void *scale, *offset;
    int64_t rows, cols, group, ngroups, steps; /* steps: 64-byte blocks a tile */
    int64_t bw, nblocks, bsteps; /* input blocks: columns a block (a divisor of the group), count, steps a block */
} Tiled;

static int tiled_init(Tiled *a, const uint8_t *tiles, int bits, int levels, int symmetric, int scale_f32,
                      const void *scale, const void *offset, int64_t rows, int64_t cols, int64_t group) {
    if ((bits != 8 && bits != 4 && bits != 2) || levels < 2 || levels > (1 << bits) || rows < 0 || cols < 1 ||
        group < 1 || (!symmetric && !offset))
        return -1;
    const int per = 8 / bits;
    const int64_t ngroups = (cols + group - 1) / group;
    if (cols % per || (ngroups > 1 && group % (4 * per))) return -2;
    int64_t bw = 4 * per; /* the widest block of at most 128 columns that divides the group */
    for (int64_t w = 128; w >= 4 * per; w -= 4 * per)
        if (ngroups == 1 || group % w == 0) {
            bw = w;
            break;
        }
    *a = (Tiled){tiles, bits, levels, symmetric, scale_f32, scale, offset, rows, cols, group, ngroups,
                 (cols / per + 3) / 4, bw, (cols + bw - 1) / bw, bw / (4 * per)};
    return 0;
}

static inline unsigned tiled_code(const Tiled *a, int64_t r, int64_t c) {
    const int per = 8 / a->bits;
    const int64_t b = c / per;
    const uint8_t byte = a->tiles[((r / 16) * a->steps + b / 4) * 64 + (r % 16) * 4 + b % 4];
    return (byte >> (a->bits * (c % per))) & ((1u << a->bits) - 1u);
}

/* float path: y[r] = sum_g s_g sum_{c in g} q_c x_c + coef_g gsum_g, coef = offset or -s (L - 1) / 2 */
static float tiled_row_float(const Tiled *a, int64_t r, const float *x, const float *gsum) {
    const int64_t t = r / 16, lane = r % 16;
    const float mid = 0.5f * (float)(a->levels - 1);
    float total = 0.0f;
    for (int64_t g = 0; g < a->ngroups; g++) {
        const int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
        const int64_t side = (t * a->ngroups + g) * 16 + lane;
        float d = 0.0f;
        for (int64_t c = c0; c < c1; c++) d += (float)tiled_code(a, r, c) * x[c];
        const float s = side_value(a->scale, a->scale_f32, side);
        const float coef = a->symmetric ? -mid * s : side_value(a->offset, a->scale_f32, side);
        total += s * d + coef * gsum[g];
    }
    return total;
}

#if HAVE_VNNI
/* the input as digit dwords xd[(k * per + f) * 3 + p] (the 4 inputs that the bytes of step k's field f multiply,
 * piece p), and per input block b (`bw` columns, inside one group): unit[b] = 2^-e_b and gsum[b] = the block's sum
 * of the rounded inputs (exact in integers, then rounded once: the offsets then multiply the same inputs as the
 * codes, so the codes' zero point, up to 255 times the spread of a row's values, does not magnify the input's
 * rounding); returns 0 if an element is not finite */
AI int tiled_block_input_t(const Tiled *a, const float *x, int32_t *xd, float *unit, float *gsum, const int per,
                          const int64_t g) {
    /* the digit bytes of 16 columns c .. c+15 (c a multiple of 4 per) in dword order (step, field), per = 1, 2, 4 */
    const __m128i order = per == 1   ? _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                          : per == 2 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                     : _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    /* dword j of piece p (lane 4 p + j) to xd[3 j + p] */
    const __m512i interleave = _mm512_setr_epi32(0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12, 13, 14, 15);
    const int64_t c0 = g * a->bw, c1 = c0 + a->bw < a->cols ? c0 + a->bw : a->cols;
    __m512 fac;
    if (!block_scale(x, c0, c1, &fac, &unit[g])) return 0;
    __m512i vsum = _mm512_setzero_si512(); /* < 2^22 * 8 a lane: exact */
    for (int64_t c = c0; c < c1; c += 16) {
        const int64_t n = c1 - c >= 16 ? 16 : c1 - c;
        __m128i piece[3];
        block_pieces16(x, c, c1, fac, &vsum, piece);
        __m512i dw = _mm512_castsi128_si512(_mm_shuffle_epi8(piece[0], order));
        dw = _mm512_inserti32x4(dw, _mm_shuffle_epi8(piece[1], order), 1);
        dw = _mm512_inserti32x4(dw, _mm_shuffle_epi8(piece[2], order), 2);
        const int64_t ndw = (n + 4 * per - 1) / (4 * per) * per; /* dwords of the steps these columns touch */
        _mm512_mask_storeu_epi32(xd + (c / 4) * 3, (__mmask16)((1u << (3 * ndw)) - 1u),
                                 _mm512_permutexvar_epi32(interleave, dw));
    }
    gsum[g] = (float)((double)_mm512_reduce_add_epi32(vsum) * (double)unit[g]);
    return 1;
}

/* the input as digit dwords xd[(k * per + f) * 3 + p] (the 4 inputs that the bytes of step k's field f multiply,
 * piece p), and per input block g (`bw` columns, inside one group): unit[g] = 2^-e_g and gsum[g] = the block's sum
 * of the rounded inputs (exact in integers, then rounded once: the offsets then multiply the same inputs as the
 * codes, so the codes' zero point, up to 255 times the spread of a row's values, does not magnify the input's
 * rounding); returns 0 if an element is not finite. xd was zeroed (the tile loop reads up to 4 steps past the
 * last). */
static int tiled_block_input(const Tiled *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t g) {
    switch (a->bits) {
    case 8: return tiled_block_input_t(a, x, xd, unit, gsum, 1, g);
    case 4: return tiled_block_input_t(a, x, xd, unit, gsum, 2, g);
    default: return tiled_block_input_t(a, x, xd, unit, gsum, 4, g);
    }
}

AI __m512 tiled_side(const void *p, int is_f32, int64_t at) {
    return is_f32 ? _mm512_loadu_ps((const float *)p + at)
                  : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
}

/* a block's sum of code times rounded input, sum q X = 65536 s2 + 256 s1 + s0 (in units of the block's 2^-e), as
 * floats. small: codes of at most 2 bits or base-3 digits, so |sum q X| <= 3 * 2^22 * 128 < 2^31 and the pieces
 * combine exactly in int32 (one rounding, in the conversion); otherwise 256 s2 + s1 in int32 (|s2| < 255 * 64 * 128),
 * converted, then one fused multiply-add with s0 */
AI __m512 pieces_dot(__m512i s0, __m512i s1, __m512i s2, const int small) {
    if (small)
        return _mm512_cvtepi32_ps(
            _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(s2, 16), _mm512_slli_epi32(s1, 8)), s0));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(s2, 8), s1)),
                           _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(s0));
}

/* one block of 16 rows into the row sums: *total += scale (unit dot - mid gsum) with symmetric codes (offset NULL),
 * else *total += scale unit dot and *total_off += offset gsum (two chains of one fused multiply-add a block) */
AI void tiles_block_sum(__m512 *total, __m512 *total_off, __m512 dot, float unit, __m512 scale, const uint8_t *offset,
                        int scale_f32, int64_t side, float mid, float gsum) {
    if (!offset) {
        *total = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(dot, _mm512_set1_ps(unit), _mm512_set1_ps(-mid * gsum)),
                                 *total);
    } else {
        *total = _mm512_fmadd_ps(scale, _mm512_mul_ps(dot, _mm512_set1_ps(unit)), *total);
        *total_off = _mm512_fmadd_ps(tiled_side(offset, scale_f32, side), _mm512_set1_ps(gsum), *total_off);
    }
}

/* *acc += the 64 products of q's unsigned bytes with the 4 signed bytes at x, broadcast. In assembly because GCC
 * copies the accumulator of the intrinsic to a new register and back on every use in a loop (twice as many
 * instructions as the products themselves); the broadcast is the instruction's own memory operand. */
AI void dpbusd_bcast(__m512i *acc, __m512i q, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*acc) : "v"(q), "m"(*x));
}

/* step k's products into the sums acc[(u * per + f) * 3 + p] (u = k mod U, 4 / per steps an iteration, so 12
 * independent sums); live = 0 loads zero codes (a block's steps past its last, in the generic loop) */
AI void tiled_step(__m512i *acc, const uint8_t *base, const int32_t *xd, int64_t k, int u, int live, int64_t ahead,
                   const int per, const int by_shift) {
    const int bits = 8 / per;
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    prefetch_line(base + k * 64, ahead);
    const __m512i v = _mm512_maskz_loadu_epi8(live ? ~(__mmask64)0 : 0, base + k * 64);
    for (int f = 0; f < per; f++) {
#ifdef __GFNI__ /* 2-bit fields 1..3: one bit-matrix product moves bits 2f, 2f + 1 to 0, 1 (instead of shift, and):
                * output bit i of a byte is the parity of the byte AND matrix byte 7 - i */
        const long long field = (long long)(1ull << (56 + 2 * f) | 1ull << (49 + 2 * f));
        const __m512i q = per == 4 && f && !by_shift ? _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(field), 0)
                          : per == 1    ? v
                                        : _mm512_and_si512(f ? _mm512_srli_epi16(v, f * bits) : v, mask);
#else
        (void)by_shift;
        const __m512i q = per == 1 ? v : _mm512_and_si512(f ? _mm512_srli_epi16(v, f * bits) : v, mask);
#endif
        const int32_t *xs = xd + (k * per + f) * 3;
        const int i = (u * per + f) * 3;
        dpbusd_bcast(&acc[i], q, xs);
        dpbusd_bcast(&acc[i + 1], q, xs + 1);
        dpbusd_bcast(&acc[i + 2], q, xs + 2);
    }
}

/* the 16 rows of tile t; per = codes a byte (1, 2, 4). NB > 0: the blocks of NB steps (all but perhaps the last)
 * run fully unrolled, without the loop branch at their end: int2 with 4-step blocks 1.2x faster in L2 */
AI void tiled_tile_t(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                     const int per, const uint8_t *next, const int NB, const int by_shift) {
    const int U = 4 / per;
    const uint8_t *base = a->tiles + t * a->steps * 64;
    const int64_t ahead = next ? next - base : 0;
    const float mid = 0.5f * (float)(a->levels - 1);
    __m512 total = _mm512_setzero_ps(), total_off = _mm512_setzero_ps(); /* two sums: two shorter chains */
    const int64_t per_group = a->ngroups == 1 ? a->nblocks : a->group / a->bw; /* blocks a group */
    for (int64_t blk = 0, g = 0, in_g = 0; blk < a->nblocks; blk++, in_g++) {
        if (in_g == per_group) {
            g++;
            in_g = 0;
        }
        const int64_t k0 = blk * a->bsteps, k1 = k0 + a->bsteps < a->steps ? k0 + a->bsteps : a->steps;
        __m512i acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
        if (NB && k1 - k0 == NB) {
#pragma GCC unroll 32
            for (int j = 0; j < NB; j++) tiled_step(acc, base, xd, k0 + j, j % U, 1, ahead, per, by_shift);
        } else {
            for (int64_t k = k0; k < k1; k += U) /* one loop body: a block's last steps past k1 load zero codes */
                for (int u = 0; u < U; u++) tiled_step(acc, base, xd, k + u, u, k + u < k1, ahead, per, by_shift);
        }
        const __m512i s0 = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[3]), _mm512_add_epi32(acc[6], acc[9]));
        const __m512i s1 = _mm512_add_epi32(_mm512_add_epi32(acc[1], acc[4]), _mm512_add_epi32(acc[7], acc[10]));
        const __m512i s2 = _mm512_add_epi32(_mm512_add_epi32(acc[2], acc[5]), _mm512_add_epi32(acc[8], acc[11]));
        const int64_t side = (t * a->ngroups + g) * 16;
        tiles_block_sum(&total, &total_off, pieces_dot(s0, s1, s2, per == 4), unit[blk],
                        tiled_side(a->scale, a->scale_f32, side),
                        a->symmetric ? NULL : (const uint8_t *)a->offset, a->scale_f32, side, mid, gsum[blk]);
    }
    const int64_t left = a->rows - t * 16;
    _mm512_mask_storeu_ps(y + t * 16, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u),
                          _mm512_add_ps(total, total_off));
}
/* tiled_tile_t unrolled for the block lengths of groups of 32, 64 and 128 columns (or rows of one group): 32 / per,
 * half and a quarter of it steps */
AI void tiled_tile_per(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next, const int per, const int by_shift) {
    const int64_t n = a->bsteps;
    const int top = 32 / per;
    if (n == top) tiled_tile_t(a, t, xd, unit, gsum, y, per, next, top, by_shift);
    else if (n == top / 2) tiled_tile_t(a, t, xd, unit, gsum, y, per, next, top / 2, by_shift);
    else if (n == top / 4) tiled_tile_t(a, t, xd, unit, gsum, y, per, next, top / 4, by_shift);
    else tiled_tile_t(a, t, xd, unit, gsum, y, per, next, 0, by_shift);
}
/* tiled_tile_t for the codes' width (and, for 2-bit codes, this CPU's field extraction: g_fields_by_shift) */
static void tiled_tile(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next) {
    switch (a->bits) {
    case 8: tiled_tile_per(a, t, xd, unit, gsum, y, next, 1, 0); break;
    case 4: tiled_tile_per(a, t, xd, unit, gsum, y, next, 2, 0); break;
    default:
        if (g_fields_by_shift) tiled_tile_per(a, t, xd, unit, gsum, y, next, 4, 1);
        else tiled_tile_per(a, t, xd, unit, gsum, y, next, 4, 0);
    }
}
#endif


#if HAVE_AVX2
#define HAVE_TILES_AVX2 1
/* The affine tiles on AVX2 (4- and 2-bit codes; 8-bit codes keep the row kernel: a pair of their products, up to
 * 2 * 255 * 128, overflows vpmaddubsw's 16-bit sums). The same tile copy and the same input digits as the VNNI tiles,
 * read half a tile (8 rows, 32 bytes of a step) at a time: vpmaddubsw multiplies the code bytes (unsigned) by the
 * broadcast digit bytes (signed) and adds them in pairs into 16-bit lanes, vpaddw sums W steps of those for all the
 * fields of a byte (exact: |a step's sum| <= per * 2 * (2^bits - 1) * 128, W of them below 2^15), and vpmaddwd by
 * ones widens a row's two lanes into its int32 sum. */

/* the input digits of block g (see tiled_block_input_t): 8 columns a vector, then the bytes of 16 columns into their
 * dword order (step, field) by one shuffle a piece. A block is whole steps (bw is a multiple of 4 per), and the bytes
 * of a last step's columns past the matrix's end are zero. */
static int tiled_block_input(const Tiled *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t g) {
    const int per = 8 / a->bits;
    const int64_t c0 = g * a->bw, c1 = c0 + a->bw < a->cols ? c0 + a->bw : a->cols;
    float fac;
    if (!block_scale8(x, c0, c1, &fac, &unit[g])) return 0;
    int8_t tp[3][128 + 16]; /* the pieces by column from c0, zero past c1 */
    memset(tp, 0, sizeof tp);
    int8_t *const out[3] = {tp[0], tp[1], tp[2]};
    __m256i vsum = _mm256_setzero_si256(); /* |X| < 2^22, 16 a lane: exact */
    for (int64_t c = c0; c < c1; c += 8) block_pieces8(x, c, c1, _mm256_set1_ps(fac), &vsum, out, c - c0);
    /* byte i of dword (s, f) is column 4 per s + per i + f of the 16 (per = 2: two steps; per = 4: one) */
    const __m128i order = per == 2 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                   : _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t cc = 0; cc < c1 - c0; cc += 16) {
        const int64_t n = c1 - c0 - cc < 16 ? c1 - c0 - cc : 16, ndw = (n + 4 * per - 1) / (4 * per) * per;
        int32_t w[3][4];
        for (int p = 0; p < 3; p++)
            _mm_storeu_si128((__m128i *)w[p], _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(tp[p] + cc)), order));
        int32_t *o = xd + ((c0 + cc) / 4) * 3; /* dword (k per + f) * 3 + p, k = c / (4 per) */
        for (int64_t j = 0; j < ndw; j++)
            for (int p = 0; p < 3; p++) o[3 * j + p] = w[p][j];
    }
    gsum[g] = (float)((double)hsum8_epi32(vsum) * (double)unit[g]);
    return 1;
}

AI __m256 tiled_side8(const void *p, int is_f32, int64_t at) {
    return is_f32 ? _mm256_loadu_ps((const float *)p + at)
                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
}

/* tiles_block_sum on 8 rows (side: their first) */
AI void tiles_block_sum8(__m256 *total, __m256 *total_off, __m256 dot, float unit, const void *scale,
                         const void *offset, int scale_f32, int64_t side, float mid, float gsum) {
    const __m256 sc = tiled_side8(scale, scale_f32, side);
    if (!offset) {
        *total = _mm256_fmadd_ps(sc, _mm256_fmadd_ps(dot, _mm256_set1_ps(unit), _mm256_set1_ps(-mid * gsum)), *total);
    } else {
        *total = _mm256_fmadd_ps(sc, _mm256_mul_ps(dot, _mm256_set1_ps(unit)), *total);
        *total_off = _mm256_fmadd_ps(tiled_side8(offset, scale_f32, side), _mm256_set1_ps(gsum), *total_off);
    }
}

/* the row sums of tile t (two halves of 8 rows) to y, the rows that exist */
AI void store_tile8x2(float *y, int64_t t, int64_t rows, const __m256 total[2], const __m256 total_off[2]) {
    float o[16];
    _mm256_storeu_ps(o, _mm256_add_ps(total[0], total_off[0]));
    _mm256_storeu_ps(o + 8, _mm256_add_ps(total[1], total_off[1]));
    const int64_t left = rows - t * 16;
    memcpy(y + t * 16, o, (size_t)(left >= 16 ? 16 : left) * sizeof(float));
}


/* step k (both halves) into the 16-bit sums s16[half][piece] */
AI void tiled_step_avx2(__m256i s16[2][3], const uint8_t *base, const int32_t *xd, int64_t k, int64_t ahead,
                        const int per) {
    const int bits = 8 / per;
    const __m256i mask = _mm256_set1_epi8((char)((1 << bits) - 1));
    prefetch_line(base + k * 64, ahead);
    const __m256i v[2] = {_mm256_loadu_si256((const __m256i *)(base + k * 64)),
                          _mm256_loadu_si256((const __m256i *)(base + k * 64 + 32))};
    for (int f = 0; f < per; f++) {
        const int32_t *xs = xd + (k * per + f) * 3;
        const __m256i x0 = _mm256_set1_epi32(xs[0]), x1 = _mm256_set1_epi32(xs[1]), x2 = _mm256_set1_epi32(xs[2]);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_and_si256(f ? _mm256_srli_epi16(v[h], f * bits) : v[h], mask);
            maddubs_add(&s16[h][0], q, x0);
            maddubs_add(&s16[h][1], q, x1);
            maddubs_add(&s16[h][2], q, x2);
        }
    }
}

/* the 16 rows of tile t (two halves of 8 rows, one int32 lane a row); per = codes a byte (2, 4). Unrolled blocks, as
 * in tiled_tile_t, measured no faster here (int2 217 against 218 us, int4 201 against 205: 2048x4096, one thread) */
AI void tiled_tile_avx2_t(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum,
                          float *y, const int per, const uint8_t *next) {
    const int W = per == 2 ? 4 : 10; /* steps in 16-bit sums: 2 * 2 * 15 * 128 * 4, 4 * 2 * 3 * 128 * 10 < 2^15 */
    const uint8_t *base = a->tiles + t * a->steps * 64;
    const int64_t ahead = next ? next - base : 0;
    const __m256i ones = _mm256_set1_epi16(1);
    const float mid = 0.5f * (float)(a->levels - 1);
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, total_off[2] = {total[0], total[0]};
    const int64_t per_group = a->ngroups == 1 ? a->nblocks : a->group / a->bw;
    for (int64_t blk = 0, g = 0, in_g = 0; blk < a->nblocks; blk++, in_g++) {
        if (in_g == per_group) {
            g++;
            in_g = 0;
        }
        const int64_t k0 = blk * a->bsteps, k1 = k0 + a->bsteps < a->steps ? k0 + a->bsteps : a->steps;
        __m256i s32[2][3];
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 3; p++) s32[h][p] = _mm256_setzero_si256();
        for (int64_t kc = k0; kc < k1; kc += W) {
            __m256i s16[2][3];
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 3; p++) s16[h][p] = _mm256_setzero_si256();
            const int64_t ke = kc + W < k1 ? kc + W : k1;
            for (int64_t k = kc; k < ke; k++) tiled_step_avx2(s16, base, xd, k, ahead, per);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 3; p++) s32[h][p] = _mm256_add_epi32(s32[h][p], _mm256_madd_epi16(s16[h][p], ones));
        }
        const int64_t side = (t * a->ngroups + g) * 16;
        for (int h = 0; h < 2; h++) { /* sum q X = 65536 s2 + 256 s1 + s0, as pieces_dot */
            const __m256i *q = s32[h];
            const __m256 dot =
                per == 4 ? _mm256_cvtepi32_ps(_mm256_add_epi32(
                               _mm256_add_epi32(_mm256_slli_epi32(q[2], 16), _mm256_slli_epi32(q[1], 8)), q[0]))
                         : _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(q[2], 8), q[1])),
                                           _mm256_set1_ps(256.0f), _mm256_cvtepi32_ps(q[0]));
            tiles_block_sum8(&total[h], &total_off[h], dot, unit[blk], a->scale, a->symmetric ? NULL : a->offset,
                             a->scale_f32, side + 8 * h, mid, gsum[blk]);
        }
    }
    store_tile8x2(y, t, a->rows, total, total_off);
}

static void tiled_tile(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next) {
    if (a->bits == 4) tiled_tile_avx2_t(a, t, xd, unit, gsum, y, 2, next);
    else tiled_tile_avx2_t(a, t, xd, unit, gsum, y, 4, next);
}
#else
#define HAVE_TILES_AVX2 0
#endif

/* the code widths (bit 8, 4, 2 of the mask; bit 3: base-3) whose tile copies an integer kernel reads on this CPU */
static int tiled_kinds(void) {
    if (!g_simd) return 0;
    if (HAVE_VNNI) return 1 << 8 | 1 << 4 | 1 << 3 | 1 << 2;
    if (HAVE_TILES_AVX2) return 1 << 4 | 1 << 3 | 1 << 2;
    return 0;
}
API int accel_tiled_kinds(void) { return tiled_kinds(); }
API int accel_tiled_available(void) { return tiled_kinds() != 0; }

API int accel_affine_tiled_matvec(const uint8_t *tiles, int bits, int levels, int symmetric, int scale_f32,
                                  const void *scale, const void *offset, int64_t rows, int64_t cols, int64_t group,
                                  const float *x, float *y, int nthreads) {
    Tiled a;
    int err = tiled_init(&a, tiles, bits, levels, symmetric, scale_f32, scale, offset, rows, cols, group);
    if (err) return err;
    int nt = threads_for(nthreads, (double)rows * cols);
#if HAVE_VNNI || HAVE_TILES_AVX2
    if (tiled_kinds() & 1 << bits) {
        const int64_t ntiles = (rows + 15) / 16;
        const int per = 8 / bits;
        const size_t nxd = (size_t)(a.steps + 4) * per * 3; /* + the tile loop's overrun */
        int32_t *xd = xalloc(nxd * sizeof(int32_t));
        float *unit = xalloc((size_t)a.nblocks * 2 * sizeof(float));
        const float *gr = unit + a.nblocks;
        memset(xd, 0, nxd * sizeof(int32_t));
        int ok = 1;
#pragma omp parallel num_threads(nt) /* the input's blocks, then (after the barrier) the tiles */
        {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < a.nblocks; g++)
                if (!tiled_block_input(&a, x, xd, unit, unit + a.nblocks, g)) {
#pragma omp atomic write
                    ok = 0;
                }
            if (ok) {
                int64_t t0, t1;
                thread_range(ntiles, &t0, &t1);
                const int64_t bytes = a.steps * 64;
                for (int64_t t = t0; t < t1; t++) {
                    const uint8_t *next = t + 1 < t1 ? a.tiles + (t + 1) * bytes : NULL;
                    tiled_tile(&a, t, xd, unit, gr, y, next);
                }
            }
        }
        free(xd);
        free(unit);
        if (ok) return 0;
    }
#endif
    float *gs = group_sums(x, cols, group, a.ngroups);
#pragma omp parallel for num_threads(nt) schedule(guided, 16)
    for (int64_t r = 0; r < rows; r++) y[r] = tiled_row_float(&a, r, x, gs);
    free(gs);
    return 0;
}

/* rows [r0, r1) of the decoded weight from the tiles, bit-exact with the format's decode (see
 * accel_affine_decode_rows) */
API int accel_affine_tiled_decode_rows(const uint8_t *tiles, int bits, int levels, int symmetric, int scale_f32,
                                       const void *scale, const void *offset, int64_t rows, int64_t cols,
                                       int64_t group, int64_t r0, int64_t r1, float *out, int nthreads) {
    Tiled a;
    int err = tiled_init(&a, tiles, bits, levels, symmetric, scale_f32, scale, offset, rows, cols, group);
    if (err) return err;
    if (r0 < 0 || r1 > rows || r0 > r1) return -1;
    const float mid = 0.5f * (float)(levels - 1);
    const int per = 8 / bits;
    const unsigned m = (1u << bits) - 1u;
    int nt = threads_for(nthreads, (double)(r1 - r0) * cols);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / 16, lane = r % 16;
        const uint8_t *src = tiles + t * a.steps * 64 + lane * 4;
        float *o = out + (r - r0) * cols;
        for (int64_t g = 0; g < a.ngroups; g++) {
            const int64_t c0 = g * group, c1 = c0 + group < cols ? c0 + group : cols;
            const int64_t side = (t * a.ngroups + g) * 16 + lane;
            const float s = side_value(scale, scale_f32, side);
            const float off = symmetric ? 0.0f : side_value(offset, scale_f32, side);
            for (int64_t c = c0; c < c1; c++) {
                const int64_t b = c / per;
                const float q = (float)((src[(b / 4) * 64 + b % 4] >> (bits * (c % per))) & m);
                o[c] = symmetric ? (q - mid) * s : q * s + off; /* two roundings: built with -ffp-contract=off */
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------- affine base-3, 16-row tiles */
/* A serving copy of `base` codes with L = 3 (5 codes a byte, digit j of weight 3^j), made once at load
 * (accel/kernels/weights.py) and interleaved in 16-row tiles as the affine tiles are: tile[t][k][lane][4], step k
 * = a row's bytes 4k .. 4k+3. The input's blocks are B columns (base3_block_width: inside one group, at most 128);
 * five blocks in a row make a super-block of S = ceil(B / 4) steps, and digit j of byte i of step s S + kk holds
 * column (5 s + j) B + 4 kk + i (zero past the block or the row). Digit vector j of every step of super-block s
 * belongs to block 5 s + j, so each of the 15 sums (5 digits x 3 input pieces) is one block's, no step is read
 * twice, and a block's sums are reduced once. (Until 2026-12-06 each row's codes ran 5 a byte from its first, a
 * step held 20 columns, and a step that two blocks shared was read once for each.) */

typedef struct {
    const uint8_t *tiles;
    int symmetric, scale_f32;
    const void *scale, *offset; /* [t][g][16] */
    int64_t rows, cols, group, ngroups, steps, bw, nblocks;
    int64_t S, nsuper; /* steps a super-block, super-blocks a row */
} Base3;

/* the input block width B: the widest divisor of the group up to 128 columns; with one group a row, the multiple of 4
 * up to 128 that costs least: the widest of those with the fewest 2 steps + blocks a row, since a block's reduction
 * costs about half a step (Zen 4, VNNI: a step 17.8 cycles, a block 8.5) */
static int64_t base3_block_width(int64_t cols, int64_t group) {
    if (cols < 1 || group < 1) return 1;
    if ((cols + group - 1) / group > 1) {
        for (int64_t w = 128; w > 1; w--)
            if (group % w == 0) return w;
        return 1;
    }
    int64_t best = 4, best_cost = INT64_MAX;
    for (int64_t w = 4; w <= 128; w += 4) {
        const int64_t blocks = (cols + w - 1) / w, cost = 2 * ((blocks + 4) / 5) * (w / 4) + blocks;
        if (cost <= best_cost) {
            best = w;
            best_cost = cost;
        }
    }
    return best;
}

API int64_t accel_base3_block_width(int64_t cols, int64_t group) { return base3_block_width(cols, group); }

static int base3_init(Base3 *a, const uint8_t *tiles, int symmetric, int scale_f32, const void *scale,
                      const void *offset, int64_t rows, int64_t cols, int64_t group) {
    if (rows < 0 || cols < 1 || group < 1 || (!symmetric && !offset)) return -1;
    const int64_t bw = base3_block_width(cols, group), nblocks = (cols + bw - 1) / bw;
    const int64_t S = (bw + 3) / 4, nsuper = (nblocks + 4) / 5;
    *a = (Base3){tiles, symmetric, scale_f32, scale, offset, rows, cols, group, (cols + group - 1) / group, nsuper * S,
                 bw, nblocks, S, nsuper};
    return 0;
}

static inline unsigned base3_code(const Base3 *a, int64_t r, int64_t c) {
    const int64_t b = c / a->bw, o = c % a->bw, k = b / 5 * a->S + o / 4;
    int64_t j = b % 5;
    unsigned byte = a->tiles[((r / 16) * a->steps + k) * 64 + (r % 16) * 4 + o % 4];
    for (; j > 0; j--) byte /= 3;
    return byte % 3;
}

static float base3_row_float(const Base3 *a, int64_t r, const float *x, const float *gsum) {
    const int64_t t = r / 16, lane = r % 16;
    float total = 0.0f;
    for (int64_t g = 0; g < a->ngroups; g++) {
        const int64_t c0 = g * a->group, c1 = c0 + a->group < a->cols ? c0 + a->group : a->cols;
        const int64_t side = (t * a->ngroups + g) * 16 + lane;
        float d = 0.0f;
        for (int64_t c = c0; c < c1; c++) d += (float)base3_code(a, r, c) * x[c];
        const float s = side_value(a->scale, a->scale_f32, side);
        total += s * d + (a->symmetric ? -s : side_value(a->offset, a->scale_f32, side)) * gsum[g];
    }
    return total;
}

#if HAVE_VNNI || HAVE_TILES_AVX2
/* block b's three input pieces (tp[p][0 .. B), zero past the block) to the dwords xd[(s S + kk) * 15 + 3 j + p]
 * (s = b / 5, j = b % 5): those that digit vector j of step s S + kk meets. The last block also zeroes the dwords of
 * the last super-block's missing blocks (whose digits are zero as well). */
static void base3_place_input(const Base3 *a, int32_t *xd, const int8_t tp[3][144], int64_t b) {
    if (b == a->nblocks - 1)
        for (int64_t m = a->nblocks; m < 5 * a->nsuper; m++)
            for (int64_t kk = 0; kk < a->S; kk++) memset(xd + ((m / 5) * a->S + kk) * 15 + (m % 5) * 3, 0, 12);
    int32_t *d = xd + (b / 5) * a->S * 15 + (b % 5) * 3;
    for (int64_t kk = 0; kk < a->S; kk++)
        for (int p = 0; p < 3; p++) memcpy(d + kk * 15 + p, tp[p] + 4 * kk, 4);
}
#endif

#if HAVE_VNNI
/* digits 0 .. BASE3_LOOKUPS - 1 come as they are from byte permutes (AVX-512 VBMI), the others times 3^j */
#ifdef __AVX512VBMI__
#define BASE3_LOOKUPS 3
#else
#define BASE3_LOOKUPS 0
#endif

/* the input digits of block b (base3_place_input); unit[b] = 2^-e_b (divided by 3^j where block 5 s + j meets
 * 3^j d_j), gsum[b] = the block's sum of the rounded inputs; 0 if an element is not finite */
static int base3_block_input(const Base3 *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t b) {
    const int64_t c0 = b * a->bw, c1 = c0 + a->bw < a->cols ? c0 + a->bw : a->cols;
    __m512 fac;
    if (!block_scale(x, c0, c1, &fac, &unit[b])) return 0;
    int8_t tp[3][144] __attribute__((aligned(64))); /* a block's (<= 128) columns, written 16 at a time */
    memset(tp, 0, sizeof tp);
    __m512i vsum = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += 16) {
        __m128i piece[3];
        block_pieces16(x, c, c1, fac, &vsum, piece);
        for (int p = 0; p < 3; p++) _mm_storeu_si128((__m128i *)(tp[p] + c - c0), piece[p]);
    }
    base3_place_input(a, xd, (const int8_t(*)[144])tp, b);
    gsum[b] = (float)((double)_mm512_reduce_add_epi32(vsum) * (double)unit[b]);
    static const float weight[5] = {1.0f, 3.0f, 9.0f, 27.0f, 81.0f};
    if (b % 5 >= BASE3_LOOKUPS) unit[b] /= weight[b % 5]; /* block 5 s + j meets 3^j d_j where j >= BASE3_LOOKUPS */
    return 1;
}

/* g_base3_low[j][r] = digit j (weight 3^j) of r, r = 0 .. 26 (a vpermb table) */
static uint8_t g_base3_low[3][64];
__attribute__((constructor)) static void base3_low_init(void) {
    for (int j = 0, w = 1; j < 3; j++, w *= 3)
        for (int r = 0; r < 64; r++) g_base3_low[j][r] = (uint8_t)(r < 27 ? (r / w) % 3 : 0);
}

/* one step's 15 products into acc[3 j + p]: digit vectors 81 d4, 27 d3, d2, d1, d0 against the dwords at xs. The top
 * two digits come out times their weights (v - r, with r = v mod w = min(v, v - w, v - 2 w) on unsigned bytes, where
 * a subtraction that wraps lands above v), the other three from the rest (< 27) by one byte permute each (without
 * AVX-512 VBMI as the top two: 9 d, 3 d, d); the weights go into those blocks' units. */
AI void base3_step(__m512i *acc, const uint8_t *step, const int32_t *xs, int64_t ahead, const __m512i low[3]) {
    const __m512i w81 = _mm512_set1_epi8(81), w162 = _mm512_set1_epi8((char)162), w27 = _mm512_set1_epi8(27),
                  w54 = _mm512_set1_epi8(54);
    prefetch_line(step, ahead); /* and the next tile's line */
    const __m512i t = _mm512_loadu_si512(step);
    const __m512i a2 = _mm512_min_epu8(_mm512_min_epu8(t, _mm512_sub_epi8(t, w81)), _mm512_sub_epi8(t, w162));
    const __m512i b2 = _mm512_min_epu8(_mm512_min_epu8(a2, _mm512_sub_epi8(a2, w27)), _mm512_sub_epi8(a2, w54));
    __m512i dig[5];
    dig[4] = _mm512_sub_epi8(t, a2);  /* 81 d4 */
    dig[3] = _mm512_sub_epi8(a2, b2); /* 27 d3 */
#ifdef __AVX512VBMI__
    for (int j = 0; j < 3; j++) dig[j] = _mm512_permutexvar_epi8(b2, low[j]);
#else /* 9 d2, 3 d1, d0 as the top two */
    (void)low;
    const __m512i w9 = _mm512_set1_epi8(9), w18 = _mm512_set1_epi8(18), w3 = _mm512_set1_epi8(3),
                  w6 = _mm512_set1_epi8(6);
    const __m512i c2 = _mm512_min_epu8(_mm512_min_epu8(b2, _mm512_sub_epi8(b2, w9)), _mm512_sub_epi8(b2, w18));
    const __m512i e2 = _mm512_min_epu8(_mm512_min_epu8(c2, _mm512_sub_epi8(c2, w3)), _mm512_sub_epi8(c2, w6));
    dig[2] = _mm512_sub_epi8(b2, c2);
    dig[1] = _mm512_sub_epi8(c2, e2);
    dig[0] = e2;
#endif
    for (int j = 0; j < 5; j++) {
        dpbusd_bcast(&acc[j * 3], dig[j], xs + j * 3);
        dpbusd_bcast(&acc[j * 3 + 1], dig[j], xs + j * 3 + 1);
        dpbusd_bcast(&acc[j * 3 + 2], dig[j], xs + j * 3 + 2);
    }
}

static void base3_tile(const Base3 *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next) {
    const uint8_t *base = a->tiles + t * a->steps * 64;
    const int64_t ahead = next ? next - base : 0, S = a->S;
    __m512i low[3];
    for (int j = 0; j < 3; j++) low[j] = _mm512_loadu_si512(g_base3_low[j]);
    const int64_t per_group = a->ngroups == 1 ? a->nblocks : a->group / a->bw;
    __m512 total = _mm512_setzero_ps(), total_off = _mm512_setzero_ps();
    for (int64_t s = 0; s < a->nsuper; s++) {
        const uint8_t *steps = base + s * S * 64;
        const int32_t *xs = xd + s * S * 15;
        __m512i acc[15];
        for (int i = 0; i < 15; i++) acc[i] = _mm512_setzero_si512();
        int64_t kk = 0;
        for (; kk + 4 <= S; kk += 4)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) base3_step(acc, steps + (kk + u) * 64, xs + (kk + u) * 15, ahead, low);
        for (; kk < S; kk++) base3_step(acc, steps + kk * 64, xs + kk * 15, ahead, low);
#pragma GCC unroll 5
        for (int j = 0; j < 5; j++) {
            const int64_t b = 5 * s + j;
            if (b >= a->nblocks) break;
            /* digits as they are: |sum q X| < 2^31, exact in int32; 3^j d_j by the float path */
            const __m512 dot = pieces_dot(acc[3 * j], acc[3 * j + 1], acc[3 * j + 2], j < BASE3_LOOKUPS || j == 0);
            const int64_t side = (t * a->ngroups + b / per_group) * 16; /* symmetric: q - (L - 1) / 2 = q - 1 */
            tiles_block_sum(&total, &total_off, dot, unit[b], tiled_side(a->scale, a->scale_f32, side),
                            a->symmetric ? NULL : (const uint8_t *)a->offset, a->scale_f32, side, 1.0f, gsum[b]);
        }
    }
    const int64_t left = a->rows - t * 16;
    _mm512_mask_storeu_ps(y + t * 16, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u),
                          _mm512_add_ps(total, total_off));
}
#endif

#if HAVE_TILES_AVX2
/* Base-3 tiles on AVX2: the same copy and input dwords as the VNNI ones, a tile as two halves of 8 rows. A
 * super-block's digits are separated once into a scratch of 5 digit vectors a step and half (32 bytes each, L1),
 * unscaled (base3_digits_avx2); then each digit vector's steps meet its block's input digits in vpmaddubsw, both
 * halves in one loop so each broadcast input digit serves two products: 3 sums of 16-bit lanes a block and half,
 * each step adding at most 2 * 2 * 128 = 512 to a lane, so a super-block's (at most 32 steps) stays exact.
 * (Sixteen registers do not hold the 15 sums of a step's five blocks at once; the scratch is what lets a block's
 * sums live in registers.) */

static int base3_block_input(const Base3 *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t b) {
    const int64_t c0 = b * a->bw, c1 = c0 + a->bw < a->cols ? c0 + a->bw : a->cols;
    float fac;
    if (!block_scale8(x, c0, c1, &fac, &unit[b])) return 0;
    int8_t tp[3][144]; /* a block's (<= 128) columns, written 8 at a time, zero past the block */
    memset(tp, 0, sizeof tp);
    int8_t *const out[3] = {tp[0], tp[1], tp[2]};
    __m256i vsum = _mm256_setzero_si256();
    for (int64_t c = c0; c < c1; c += 8) block_pieces8(x, c, c1, _mm256_set1_ps(fac), &vsum, out, c - c0);
    base3_place_input(a, xd, (const int8_t(*)[144])tp, b);
    gsum[b] = (float)((double)hsum8_epi32(vsum) * (double)unit[b]);
    return 1;
}

/* the digits of 32 bytes t, unscaled, to d[j]: r = t mod w = min(t, t - w, t - 2 w) on unsigned bytes (a subtraction
 * that wraps lands above t), then d from t - r in {0, w, 2 w}: by a shift for w = 81 (0, 1, 2 times 64 and more), by
 * a byte lookup of its low nibble for w = 27 and 9 (0, 11, 6 and 0, 9, 2); the rest below 9 by two lookups */
AI void base3_digits_avx2(__m256i t, __m256i d[5]) {
    const __m256i t27 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0,
                                         0, 1, 0, 0, 0, 0);
    const __m256i t9 = _mm256_setr_epi8(0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 1,
                                        0, 0, 0, 0, 0, 0);
    const __m256i div3 = _mm256_setr_epi8(0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 0,
                                          0, 0, 0, 0, 0, 0);
    const __m256i mod3 = _mm256_setr_epi8(0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0,
                                          0, 0, 0, 0, 0, 0);
    static const int w[3] = {81, 27, 9};
    for (int i = 0; i < 3; i++) {
        const __m256i r = _mm256_min_epu8(_mm256_min_epu8(t, _mm256_sub_epi8(t, _mm256_set1_epi8((char)w[i]))),
                                          _mm256_sub_epi8(t, _mm256_set1_epi8((char)(2 * w[i]))));
        const __m256i dw = _mm256_sub_epi8(t, r);
        d[4 - i] = i == 0   ? _mm256_and_si256(_mm256_srli_epi16(dw, 6), _mm256_set1_epi8(3))
                   : i == 1 ? _mm256_shuffle_epi8(t27, dw)
                            : _mm256_shuffle_epi8(t9, dw);
        t = r;
    }
    d[1] = _mm256_shuffle_epi8(div3, t);
    d[0] = _mm256_shuffle_epi8(mod3, t);
}

static void base3_tile(const Base3 *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next) {
    const uint8_t *base = a->tiles + t * a->steps * 64;
    const int64_t ahead = next ? next - base : 0, S = a->S;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t per_group = a->ngroups == 1 ? a->nblocks : a->group / a->bw;
    __m256i digits[5][32][2]; /* a super-block's digit vectors: [j][kk][half tile], S <= 32 */
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, total_off[2] = {total[0], total[0]};
    for (int64_t s = 0; s < a->nsuper; s++) {
        const int64_t b0 = 5 * s;
        const int nb = a->nblocks - b0 < 5 ? (int)(a->nblocks - b0) : 5;
        const uint8_t *steps = base + s * S * 64;
        const int32_t *xs = xd + s * S * 15;
        for (int64_t kk = 0; kk < S; kk++) {
            prefetch_line(steps + kk * 64, ahead);
            for (int h = 0; h < 2; h++) {
                __m256i d[5];
                base3_digits_avx2(_mm256_loadu_si256((const __m256i *)(steps + kk * 64 + 32 * h)), d);
                for (int j = 0; j < 5; j++) digits[j][kk][h] = d[j];
            }
        }
        for (int j = 0; j < nb; j++) {
            __m256i s16[2][3];
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 3; p++) s16[h][p] = _mm256_setzero_si256();
            for (int64_t kk = 0; kk < S; kk++) {
                const int32_t *xk = xs + kk * 15 + 3 * j;
                for (int p = 0; p < 3; p++) {
                    const __m256i xp = _mm256_set1_epi32(xk[p]);
                    maddubs_add(&s16[0][p], digits[j][kk][0], xp);
                    maddubs_add(&s16[1][p], digits[j][kk][1], xp);
                }
            }
            const int64_t b = b0 + j, side = (t * a->ngroups + b / per_group) * 16;
            for (int h = 0; h < 2; h++) {
                /* |sum q X| <= 2 * 2^22 * 128: the pieces combine exactly in int32 */
                const __m256i q0 = _mm256_madd_epi16(s16[h][0], ones), q1 = _mm256_madd_epi16(s16[h][1], ones);
                const __m256i q2 = _mm256_madd_epi16(s16[h][2], ones);
                const __m256 dot = _mm256_cvtepi32_ps(
                    _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q2, 16), _mm256_slli_epi32(q1, 8)), q0));
                tiles_block_sum8(&total[h], &total_off[h], dot, unit[b], a->scale, a->symmetric ? NULL : a->offset,
                                 a->scale_f32, side + 8 * h, 1.0f, gsum[b]); /* symmetric: q - (L - 1) / 2 = q - 1 */
            }
        }
    }
    store_tile8x2(y, t, a->rows, total, total_off);
}
#endif

API int accel_base3_tiled_matvec(const uint8_t *tiles, int symmetric, int scale_f32, const void *scale,
                                 const void *offset, int64_t rows, int64_t cols, int64_t group, const float *x,
                                 float *y, int nthreads) {
    Base3 a;
    int err = base3_init(&a, tiles, symmetric, scale_f32, scale, offset, rows, cols, group);
    if (err) return err;
    int nt = threads_for(nthreads, (double)rows * cols);
#if HAVE_VNNI || HAVE_TILES_AVX2
    if (tiled_kinds() & 1 << 3) {
        const int64_t ntiles = (rows + 15) / 16;
        int32_t *xd = xalloc((size_t)(a.nsuper * a.S * 15) * sizeof(int32_t)); /* 15 input dwords a step */
        float *unit = xalloc((size_t)a.nblocks * 2 * sizeof(float));
        int ok = 1;
#pragma omp parallel num_threads(nt) /* the input's blocks, then (after the barrier) the tiles */
        {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < a.nblocks; b++)
                if (!base3_block_input(&a, x, xd, unit, unit + a.nblocks, b)) {
#pragma omp atomic write
                    ok = 0;
                }
            if (ok) {
                int64_t t0, t1;
                thread_range(ntiles, &t0, &t1);
                for (int64_t t = t0; t < t1; t++)
                    base3_tile(&a, t, xd, unit, unit + a.nblocks, y,
                               t + 1 < t1 ? a.tiles + (t + 1) * a.steps * 64 : NULL);
            }
        }
        free(xd);
        free(unit);
        if (ok) return 0;
    }
#endif
    float *gs = group_sums(x, cols, group, a.ngroups);
#pragma omp parallel for num_threads(nt) schedule(guided, 16)
    for (int64_t r = 0; r < rows; r++) y[r] = base3_row_float(&a, r, x, gs);
    free(gs);
    return 0;
}

API int accel_base3_tiled_decode_rows(const uint8_t *tiles, int symmetric, int scale_f32, const void *scale,
                                      const void *offset, int64_t rows, int64_t cols, int64_t group, int64_t r0,
                                      int64_t r1, float *out, int nthreads) {
    Base3 a;
    int err = base3_init(&a, tiles, symmetric, scale_f32, scale, offset, rows, cols, group);
    if (err) return err;
    if (r0 < 0 || r1 > rows || r0 > r1) return -1;
    int nt = threads_for(nthreads, (double)(r1 - r0) * cols);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / 16, lane = r % 16;
        float *o = out + (r - r0) * cols;
        for (int64_t g = 0; g < a.ngroups; g++) {
            const int64_t c0 = g * group, c1 = c0 + group < cols ? c0 + group : cols;
            const int64_t side = (t * a.ngroups + g) * 16 + lane;
            const float s = side_value(scale, scale_f32, side);
            const float off = symmetric ? 0.0f : side_value(offset, scale_f32, side);
            for (int64_t c = c0; c < c1; c++) {
                const float q = (float)base3_code(&a, r, c);
                o[c] = symmetric ? (q - 1.0f) * s : q * s + off; /* two roundings: built with -ffp-contract=off */
            }
        }
    }
    return 0;
}

/* -------------------------------------------------------------------------------------------- bandwidth */

/* dst <- src with every thread copying its own contiguous slice; the copy bandwidth bench/gemv.py compares to */
API void accel_copy(float *dst, const float *src, int64_t n, int nthreads) {
    int nt = threads_for(nthreads, (double)n);
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        int64_t a = n * t / k, b = n * (t + 1) / k;
        memcpy(dst + a, src + a, (size_t)(b - a) * sizeof(float));
    }
}

/* Sum of src, every thread reading its own contiguous slice: the read-only bandwidth bench/gemv.py also compares
 * to, in two patterns because the faster one changes with the host. streams = 2: two streams in turn (4 KB blocks
 * from each half alternately, each line prefetched 1 KB ahead), the fastest in a scratch probe against 1-8 streams
 * a thread, 1 or 4 KB blocks and other prefetch distances and levels on the Zen 5 host (36-38 GB/s, 2026-12-03).
 * streams = 1: one plain stream, no software prefetch, the fastest on the Zen 4 host (28-68 GB/s against 20-30 for
 * streams = 2 in each of the 36 probe pairs of six bench/gemv.py runs, 2026-12-06; docs/kernels.md, "Streaming"). */
API float accel_read(const float *src, int64_t n, int nthreads, int streams) {
    int nt = threads_for(nthreads, (double)n);
    float total = 0.0f;
#pragma omp parallel num_threads(nt) reduction(+ : total)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        const int64_t a = n * t / k, b = n * (t + 1) / k;
        float acc[16] = {0};
        if (streams == 1) {
            int64_t i = a;
            for (; i + 16 <= b; i += 16)
                for (int l = 0; l < 16; l++) acc[l] += src[i + l];
            for (; i < b; i++) acc[0] += src[i];
        } else {
            const int64_t mid = a + (b - a) / 2, block = 1024; /* floats: 4 KB */
            const int64_t start[2] = {a, mid}, end[2] = {mid, b};
            for (int64_t off = 0; off < b - mid; off += block) {
                for (int s = 0; s < 2; s++) {
                    const int64_t i0 = start[s] + off, i1 = i0 + block < end[s] ? i0 + block : end[s];
                    int64_t i = i0;
                    for (; i + 16 <= i1; i += 16) {
                        __builtin_prefetch(src + i + 256, 0, 3);
                        for (int l = 0; l < 16; l++) acc[l] += src[i + l];
                    }
                    for (; i < i1; i++) acc[0] += src[i];
                }
            }
        }
        for (int l = 0; l < 16; l++) total += acc[l];
    }
    return total;
}
