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
 * and of the 8-, 4- and 2-bit affine tiles (vpmaddwd, vpmaddubsw) and the base-3 tiles; the other integer tile
 * kernels are AVX-512 only, so their serving copies are not made there (accel_tiled_kinds). */
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

/* *acc += the int32 pair sums of q's signed 16-bit lanes times x's (vpmaddwd), as one asm statement like
 * maddubs_add */
AI void madd_add(__m256i *acc, __m256i q, __m256i x) {
    __m256i t;
    __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(*acc), "=&x"(t) : "x"(q), "x"(x));
}

/* lanes i < n all ones (AVX2's masked loads and gathers read the top bit of a lane) */
static inline __m256i lanes8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

/* The kernels, one file a family, in this order (each uses what the ones before it define). */
#include "rht.c"
#include "affine_rows.c"
#include "leech_rows.c"
#include "bfp_input.c"
#include "leech_tiles.c"
#include "leech_matvec.c"
#include "affine_tiles.c"
#include "base3_tiles.c"
#include "bandwidth.c"
