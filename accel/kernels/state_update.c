// One decode step of a gated delta rule (GDN: one decay per head; KDA: one decay per d_k channel) on a recurrent
// state [B, H, dk, dv], for accel/kernels/state_update.py.
//
//   S   <- diag(alpha) S                  alpha = exp(g): g per head (GDN) or per channel (KDA)
//   d   <- beta * (v - S^T k)
//   S   <- S + k d^T
//   o   <- S^T q
//
// accel_state_step_f32 updates a float32 state in place. accel_state_step_mixed reads and writes the DAMP storage
// directly: each channel (row of dv values) of a head is either a float16 row (`hi`) or an int8 row with one
// float16 scale (`lo`: scale = absmax / 127 rounded to float16, codes = round-half-even(x * (1 / scale)) clamped
// to +-127, the rule of accel.runtime.state_cache). slot[h * dk + r] >= 0 is row r's index into hi, < 0 is
// -(index into lo) - 1. A head's rows are decoded once into a dk x dv float scratch (one head at a time, never the
// whole state), updated there, and encoded back. (b, h) pairs run in parallel with OpenMP.
//
// Both kernels use the same vector helpers (AVX-512 when the compiler targets it, else AVX2 + F16C, else scalar),
// so the float32 baseline is as vectorised as the DAMP kernel.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16
typedef __m512 vf;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps((p), (x))
#define VSET(a) _mm512_set1_ps(a)
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VABS(a) _mm512_abs_ps(a)
#define VZERO() _mm512_setzero_ps()
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline vf load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void store_f16(uint16_t *p, vf x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void store_i8(int8_t *p, vf x) {  // x already rounded and clamped to +-127
    _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
}
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps((p), (x))
#define VSET(a) _mm256_set1_ps(a)
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VABS(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (a))
#define VZERO() _mm256_setzero_ps()
static inline float vhmax(vf x) {
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, x);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}
static inline vf load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void store_f16(uint16_t *p, vf x) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void store_i8(int8_t *p, vf x) {
    __m256i i32 = _mm256_cvtps_epi32(x);
    __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(p16, p16));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
#define W 0
#endif

typedef _Float16 f16;

static inline float half_bits_to_float(uint16_t bits) {
    f16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}

static inline uint16_t float_to_half_bits(float x) {
    f16 h = (f16)x;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

static inline float decay_of(const float *g, int kda, long bh, int dk, int r) {
    return kda ? expf(g[bh * dk + r]) : expf(g[bh]);
}

static inline float clamp127(float x) { return x > 127.0f ? 127.0f : (x < -127.0f ? -127.0f : x); }

// --- row primitives: `row` is float32 scratch or state, `mem`/`out` are dv-float accumulators ---

// row = a * row; mem += k * row
static inline void decay_dot(float *restrict row, float *restrict mem, float a, float k, int dv) {
    int j = 0;
#if W
    const vf va = VSET(a), vk = VSET(k);
    for (; j + W <= dv; j += W) {
        vf x = VMUL(va, VLOAD(row + j));
        VSTORE(row + j, x);
        VSTORE(mem + j, VADD(VLOAD(mem + j), VMUL(vk, x)));
    }
#endif
    for (; j < dv; j++) {
        row[j] *= a;
        mem[j] += k * row[j];
    }
}

// row = a * float16 src; mem += k * row
static inline void load_hi_dot(float *restrict row, const uint16_t *src, float *restrict mem, float a, float k,
                               int dv) {
    int j = 0;
#if W
    const vf va = VSET(a), vk = VSET(k);
    for (; j + W <= dv; j += W) {
        vf x = VMUL(va, load_f16(src + j));
        VSTORE(row + j, x);
        VSTORE(mem + j, VADD(VLOAD(mem + j), VMUL(vk, x)));
    }
#endif
    for (; j < dv; j++) {
        row[j] = a * half_bits_to_float(src[j]);
        mem[j] += k * row[j];
    }
}

// row = a * (codes * scale); mem += k * row
static inline void load_lo_dot(float *restrict row, const int8_t *src, float sc, float *restrict mem, float a,
                               float k, int dv) {
    int j = 0;
#if W
    const vf vs = VSET(sc), va = VSET(a), vk = VSET(k);
    for (; j + W <= dv; j += W) {
        vf x = VMUL(va, VMUL(load_i8(src + j), vs));
        VSTORE(row + j, x);
        VSTORE(mem + j, VADD(VLOAD(mem + j), VMUL(vk, x)));
    }
#endif
    for (; j < dv; j++) {
        row[j] = a * ((float)src[j] * sc);
        mem[j] += k * row[j];
    }
}

// row += k * delta; out += q * row; returns max |row|
static inline float update_out(float *restrict row, const float *restrict delta, float *restrict out, float k,
                               float q, int dv) {
    int j = 0;
    float amax = 0.0f;
#if W
    const vf vk = VSET(k), vq = VSET(q);
    vf vmax = VZERO();
    for (; j + W <= dv; j += W) {
        vf x = VADD(VLOAD(row + j), VMUL(vk, VLOAD(delta + j)));
        VSTORE(row + j, x);
        VSTORE(out + j, VADD(VLOAD(out + j), VMUL(vq, x)));
        vmax = VMAX(vmax, VABS(x));
    }
    amax = vhmax(vmax);
#endif
    for (; j < dv; j++) {
        row[j] += k * delta[j];
        out[j] += q * row[j];
        const float ax = fabsf(row[j]);
        amax = ax > amax ? ax : amax;
    }
    return amax;
}

static inline void store_hi_row(uint16_t *dst, const float *row, int dv) {
    int j = 0;
#if W
    for (; j + W <= dv; j += W) store_f16(dst + j, VLOAD(row + j));
#endif
    for (; j < dv; j++) dst[j] = float_to_half_bits(row[j]);
}

static inline void store_lo_row(int8_t *dst, const float *row, float inv, int dv) {
    int j = 0;
#if W
    const vf vi = VSET(inv), hi = VSET(127.0f), lo = VSET(-127.0f);
    for (; j + W <= dv; j += W) {
        vf x = vround(VMUL(VLOAD(row + j), vi));
#if W == 16
        store_i8(dst + j, _mm512_max_ps(lo, _mm512_min_ps(hi, x)));
#else
        store_i8(dst + j, _mm256_max_ps(lo, _mm256_min_ps(hi, x)));
#endif
    }
#endif
    for (; j < dv; j++) dst[j] = (int8_t)clamp127(__builtin_roundevenf(row[j] * inv));
}

static inline void delta_rule(float *restrict mem, const float *restrict v, float beta, float *restrict out,
                              int dv) {
    for (int j = 0; j < dv; j++) {
        mem[j] = beta * (v[j] - mem[j]);
        out[j] = 0.0f;
    }
}

int accel_state_simd_width(void) { return W; }

int accel_state_step_f32(int B, int H, int dk, int dv, int kda, float *S, const float *q, const float *k,
                         const float *v, const float *g, const float *beta, float *o, int threads) {
    if (threads > 0) omp_set_num_threads(threads);
    int failed = 0;
#pragma omp parallel
    {
        float *mem = (float *)malloc(sizeof(float) * (size_t)dv);
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!mem) continue;
            float *s = S + bh * (long)dk * dv;
            const float *kk = k + bh * dk, *qq = q + bh * dk;
            float *oo = o + bh * dv;
            memset(mem, 0, sizeof(float) * (size_t)dv);
            for (int r = 0; r < dk; r++) decay_dot(s + (long)r * dv, mem, decay_of(g, kda, bh, dk, r), kk[r], dv);
            delta_rule(mem, v + bh * dv, beta[bh], oo, dv);
            for (int r = 0; r < dk; r++) update_out(s + (long)r * dv, mem, oo, kk[r], qq[r], dv);
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

int accel_state_step_mixed(int B, int H, int dk, int dv, int kda, const int32_t *slot, int n_hi, int n_lo,
                           uint16_t *hi, int8_t *lo, uint16_t *lo_scale, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, float *o, int threads) {
    if (threads > 0) omp_set_num_threads(threads);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = (float *)malloc(sizeof(float) * ((size_t)dk + 1) * dv);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!scratch) continue;
            const long b = bh / H, h = bh % H;
            float *mem = scratch + (long)dk * dv;
            const float *kk = k + bh * dk, *qq = q + bh * dk;
            float *oo = o + bh * dv;
            memset(mem, 0, sizeof(float) * (size_t)dv);
            for (int r = 0; r < dk; r++) {  // decode + decay + S^T k, one pass over the stored rows
                const float a = decay_of(g, kda, bh, dk, r);
                const int32_t sl = slot[h * dk + r];
                if (sl >= 0) {
                    load_hi_dot(scratch + (long)r * dv, hi + (b * n_hi + sl) * (long)dv, mem, a, kk[r], dv);
                } else {
                    const long li = b * n_lo + (-sl - 1);
                    load_lo_dot(scratch + (long)r * dv, lo + li * (long)dv, half_bits_to_float(lo_scale[li]), mem,
                                a, kk[r], dv);
                }
            }
            delta_rule(mem, v + bh * dv, beta[bh], oo, dv);
            for (int r = 0; r < dk; r++) {  // rank-1 update + output, then encode the row back
                float *row = scratch + (long)r * dv;
                const float amax = update_out(row, mem, oo, kk[r], qq[r], dv);
                const int32_t sl = slot[h * dk + r];
                if (sl >= 0) {
                    store_hi_row(hi + (b * n_hi + sl) * (long)dv, row, dv);
                } else {
                    const long li = b * n_lo + (-sl - 1);
                    float sc = amax / 127.0f;
                    if (sc < 0x1p-24f) sc = 0x1p-24f;
                    lo_scale[li] = float_to_half_bits(sc);
                    store_lo_row(lo + li * (long)dv, row, 1.0f / half_bits_to_float(lo_scale[li]), dv);
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
