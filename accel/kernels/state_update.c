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
// -(index into lo) - 1. Each head takes two passes over its stored rows: the first accumulates S^T k of the decayed
// state straight from the codes (read only), the second decodes each row again, decays and updates it, adds it to
// o, and encodes it back in place (an int8 row through a dv-float buffer, for its new scale). No float32 copy of
// the state, or of a head, is ever made. (b, h) pairs run in parallel with OpenMP. The float32 kernel takes the
// same two passes (read; read-modify-write).
//
// Both kernels use the same vector helpers (AVX-512 when the compiler targets it, else AVX2 + F16C + FMA, else
// scalar), so the float32 baseline is as vectorised as the DAMP kernel; vector paths use fused multiply-adds.
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
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
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
static inline void store_i8(int8_t *p, vf x) {  // round half to even, saturate to int8
    _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps((p), (x))
#define VSET(a) _mm256_set1_ps(a)
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
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
static inline void store_i8(int8_t *p, vf x) {  // round half to even, saturate to int8
    __m256i i32 = _mm256_cvtps_epi32(x);
    __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(p16, p16));
}
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

// alpha[r] = exp(g) of row r of head bh: one exp per head (GDN) or per channel (KDA)
static inline void decays(float *alpha, const float *g, int kda, long bh, int dk) {
    if (kda) {
        for (int r = 0; r < dk; r++) alpha[r] = expf(g[bh * dk + r]);
    } else {
        const float a = expf(g[bh]);
        for (int r = 0; r < dk; r++) alpha[r] = a;
    }
}

static inline float clamp127(float x) { return x > 127.0f ? 127.0f : (x < -127.0f ? -127.0f : x); }

// --- row primitives: `mem` and `out` are dv-float accumulators, c/a/k/q scalars of the row ---

// mem += c * row (float32)
static inline void dot_f32(const float *restrict src, float c, float *restrict mem, int dv) {
    int j = 0;
#if W
    const vf vc = VSET(c);
    for (; j + W <= dv; j += W) VSTORE(mem + j, VFMA(vc, VLOAD(src + j), VLOAD(mem + j)));
#endif
    for (; j < dv; j++) mem[j] += c * src[j];
}

// mem += c * row (float16)
static inline void dot_hi(const uint16_t *restrict src, float c, float *restrict mem, int dv) {
    int j = 0;
#if W
    const vf vc = VSET(c);
    for (; j + W <= dv; j += W) VSTORE(mem + j, VFMA(vc, load_f16(src + j), VLOAD(mem + j)));
#endif
    for (; j < dv; j++) mem[j] += c * half_bits_to_float(src[j]);
}

// mem += c * codes (int8; c carries the row's scale)
static inline void dot_lo(const int8_t *restrict src, float c, float *restrict mem, int dv) {
    int j = 0;
#if W
    const vf vc = VSET(c);
    for (; j + W <= dv; j += W) VSTORE(mem + j, VFMA(vc, load_i8(src + j), VLOAD(mem + j)));
#endif
    for (; j < dv; j++) mem[j] += c * (float)src[j];
}

// row = a * row + k * delta (float32, in place); out += q * row
static inline void update_f32(float *restrict row, float a, float k, const float *restrict delta, float q,
                              float *restrict out, int dv) {
    int j = 0;
#if W
    const vf va = VSET(a), vk = VSET(k), vq = VSET(q);
    for (; j + W <= dv; j += W) {
        vf x = VFMA(vk, VLOAD(delta + j), VMUL(va, VLOAD(row + j)));
        VSTORE(row + j, x);
        VSTORE(out + j, VFMA(vq, x, VLOAD(out + j)));
    }
#endif
    for (; j < dv; j++) {
        row[j] = a * row[j] + k * delta[j];
        out[j] += q * row[j];
    }
}

// the same on a float16 row, rewritten in place
static inline void update_hi(uint16_t *restrict row, float a, float k, const float *restrict delta, float q,
                             float *restrict out, int dv) {
    int j = 0;
#if W
    const vf va = VSET(a), vk = VSET(k), vq = VSET(q);
    for (; j + W <= dv; j += W) {
        vf x = VFMA(vk, VLOAD(delta + j), VMUL(va, load_f16(row + j)));
        store_f16(row + j, x);
        VSTORE(out + j, VFMA(vq, x, VLOAD(out + j)));
    }
#endif
    for (; j < dv; j++) {
        const float x = a * half_bits_to_float(row[j]) + k * delta[j];
        row[j] = float_to_half_bits(x);
        out[j] += q * x;
    }
}

// x = c * codes + k * delta into buf (c = decay * scale); out += q * x; returns max |x|
static inline float update_lo(const int8_t *restrict src, float c, float k, const float *restrict delta, float q,
                              float *restrict out, float *restrict buf, int dv) {
    int j = 0;
    float amax = 0.0f;
#if W
    const vf vc = VSET(c), vk = VSET(k), vq = VSET(q);
    vf vmax = VZERO();
    for (; j + W <= dv; j += W) {
        vf x = VFMA(vk, VLOAD(delta + j), VMUL(vc, load_i8(src + j)));
        VSTORE(buf + j, x);
        VSTORE(out + j, VFMA(vq, x, VLOAD(out + j)));
        vmax = VMAX(vmax, VABS(x));
    }
    amax = vhmax(vmax);
#endif
    for (; j < dv; j++) {
        buf[j] = c * (float)src[j] + k * delta[j];
        out[j] += q * buf[j];
        const float ax = fabsf(buf[j]);
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

// codes = clamp(round-half-even(row * inv), -127, 127). The vector conversion rounds half to even (the default
// MXCSR mode) and the narrowing saturates at +127, so only the lower clamp is explicit.
static inline void store_lo_row(int8_t *dst, const float *row, float inv, int dv) {
    int j = 0;
#if W
    const vf vi = VSET(inv), lo = VSET(-127.0f);
    for (; j + W <= dv; j += W) store_i8(dst + j, VMAX(lo, VMUL(VLOAD(row + j), vi)));
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
    const int nt = threads > 0 ? threads : omp_get_max_threads();  // no global side effect
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        float *mem = (float *)malloc(sizeof(float) * ((size_t)dv + dk));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!mem) continue;
            float *s = S + bh * (long)dk * dv, *alpha = mem + dv;
            const float *kk = k + bh * dk, *qq = q + bh * dk;
            float *oo = o + bh * dv;
            decays(alpha, g, kda, bh, dk);
            memset(mem, 0, sizeof(float) * (size_t)dv);
            for (int r = 0; r < dk; r++) dot_f32(s + (long)r * dv, alpha[r] * kk[r], mem, dv);
            delta_rule(mem, v + bh * dv, beta[bh], oo, dv);
            for (int r = 0; r < dk; r++) update_f32(s + (long)r * dv, alpha[r], kk[r], mem, qq[r], oo, dv);
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

int accel_state_step_mixed(int B, int H, int dk, int dv, int kda, const int32_t *slot, int n_hi, int n_lo,
                           uint16_t *hi, int8_t *lo, uint16_t *lo_scale, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, float *o, int threads) {
    const int nt = threads > 0 ? threads : omp_get_max_threads();  // no global side effect
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        float *mem = (float *)malloc(sizeof(float) * (2 * (size_t)dv + dk));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!mem) continue;
            const long b = bh / H, h = bh % H;
            float *buf = mem + dv, *alpha = mem + 2 * dv;
            const float *kk = k + bh * dk, *qq = q + bh * dk;
            float *oo = o + bh * dv;
            decays(alpha, g, kda, bh, dk);
            memset(mem, 0, sizeof(float) * (size_t)dv);
            for (int r = 0; r < dk; r++) {  // S^T k of the decayed state, read straight from the storage
                const float ak = alpha[r] * kk[r];
                const int32_t sl = slot[h * dk + r];
                if (sl >= 0) {
                    dot_hi(hi + (b * n_hi + sl) * (long)dv, ak, mem, dv);
                } else {
                    const long li = b * n_lo + (-sl - 1);
                    dot_lo(lo + li * (long)dv, ak * half_bits_to_float(lo_scale[li]), mem, dv);
                }
            }
            delta_rule(mem, v + bh * dv, beta[bh], oo, dv);
            for (int r = 0; r < dk; r++) {  // decay + rank-1 update + output, encoded back row by row
                const float a = alpha[r];
                const int32_t sl = slot[h * dk + r];
                if (sl >= 0) {
                    update_hi(hi + (b * n_hi + sl) * (long)dv, a, kk[r], mem, qq[r], oo, dv);
                } else {
                    const long li = b * n_lo + (-sl - 1);
                    int8_t *codes = lo + li * (long)dv;
                    const float amax = update_lo(codes, a * half_bits_to_float(lo_scale[li]), kk[r], mem, qq[r],
                                                 oo, buf, dv);
                    float sc = amax / 127.0f;
                    if (sc < 0x1p-24f) sc = 0x1p-24f;
                    lo_scale[li] = float_to_half_bits(sc);
                    store_lo_row(codes, buf, 1.0f / half_bits_to_float(lo_scale[li]), dv);
                }
            }
        }
        free(mem);
    }
    return failed ? -1 : 0;
}
