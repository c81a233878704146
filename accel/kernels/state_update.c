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
// the state is ever made. (b, h) pairs run in parallel with OpenMP. The float32 kernel takes the same two passes
// (read; read-modify-write).
//
// With AVX-512 and d_v = 16..128 in steps of 16 (Qwen3-Next's 128, the fixtures' 64) both kernels take a
// register-resident path (head_f32_nv, head_mixed_nv): S^T k, delta and the output live in vector registers, and
// the DAMP kernel encodes int8 rows 16 at a time (their scales computed in one vector). Same arithmetic in the same
// order, so the same bits as the generic loops (tests/test_state_update.py checks it against a zero-padded d_v
// that takes them).
//
// Both kernels use the same vector helpers (AVX-512 when the compiler targets it, else AVX2 + F16C + FMA, else
// scalar), so the float32 baseline is as vectorised as the DAMP kernel; vector paths use fused multiply-adds.
//
// accel_state_step_water (the last section) takes the same step on the storage of an `alloc=water` map, where each
// channel has its own INT-K width (K = 2..16) and its codes sit in K-bit fields of a bit stream.
#include <math.h>
#include "csrc/omp_compat.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// round half to even: nearbyintf in the default rounding mode (what __builtin_roundevenf gives where the compiler
// has it; clang 14 does not)
static inline float round_even(float x) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_roundevenf)
    return __builtin_roundevenf(x);
#endif
#endif
    return nearbyintf(x);
}

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

// float16 <-> float32, round to nearest even: _Float16 where the compiler has it on this target (gcc 12 on any
// x86-64, clang on arm64 and from 15 on x86), else F16C, else in integer arithmetic (clang 14 on baseline x86-64)
#if defined(__FLT16_MAX__)
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
#elif defined(__F16C__)
static inline float half_bits_to_float(uint16_t bits) { return _cvtsh_ss(bits); }
static inline uint16_t float_to_half_bits(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 31) u = sign | 0x7f800000u | (m << 13); // inf, NaN (payload kept)
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else { // subnormal: m * 2^-24, exact in float32
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_half_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); // NaN, quiet
    if (a >= 0x477ff000u) return sign | 0x7c00u; // rounds past 65504: inf
    if (a < 0x38800000u) { // below 2^-14: a subnormal half, m = round_even(|x| * 2^24)
        float f;
        memcpy(&f, &a, 4);
        return sign | (uint16_t)nearbyintf(f * 16777216.0f);
    }
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u); // round the 13 dropped bits to nearest even
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}
#endif

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
    for (; j < dv; j++) dst[j] = (int8_t)clamp127(round_even(row[j] * inv));
}

static inline void delta_rule(float *restrict mem, const float *restrict v, float beta, float *restrict out,
                              int dv) {
    for (int j = 0; j < dv; j++) {
        mem[j] = beta * (v[j] - mem[j]);
        out[j] = 0.0f;
    }
}

#if W == 16
// --- register-resident heads: d_v = 16 * NV with NV <= 8 (d_v 16 ... 128). S^T k, delta and the output stay in
// vector registers (NV each), so a row costs its loads, its arithmetic and its store, and no accumulator traffic
// through memory. The arithmetic is the generic path's, operation for operation (same fused multiply-adds in the
// same order, same rounding), so both give the same bits; NV is a constant in each instantiation (the switch
// below), so the compiler unrolls the vector loops and keeps the arrays in registers.
//
// Pass 1 asks for the bytes AHEAD of each row it reads (into L2), in every stream it reads (float32 rows; float16
// and int8 rows): the rows of a head sit one after another, and the next head's follow. Measured at 36 layers x
// batch 4 of Qwen3-Next: DAMP 18.9 -> 16.8 ms, float32 unchanged (it streams at the copy bandwidth already).
#define AHEAD 4096

// codes of 64 values (four vectors) at once: round-half-even to int32, then two saturating packs to int8 (they
// interleave 128-bit lanes; one permutation puts the dwords back in order) and the lower clamp to -127 on the bytes.
// The same codes as store_i8 with the float clamp, four vectors at a time: 4 shuffles instead of 8, one clamp
// instead of 4.
static inline void store_i8_x4(int8_t *p, vf x0, vf x1, vf x2, vf x3, vf inv) {
    const __m512i a = _mm512_cvtps_epi32(VMUL(x0, inv)), b = _mm512_cvtps_epi32(VMUL(x1, inv));
    const __m512i c = _mm512_cvtps_epi32(VMUL(x2, inv)), d = _mm512_cvtps_epi32(VMUL(x3, inv));
    const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(p, _mm512_max_epi8(_mm512_permutexvar_epi32(order, bytes), _mm512_set1_epi8(-127)));
}

// an int8 row's codes from its updated values x (d_v = NV * W floats) and 1 / its float16 scale
static inline __attribute__((always_inline)) void encode_lo_nv(const int NV, int8_t *restrict codes,
                                                                 const float *restrict x, vf inv) {
    int v = 0;
    for (; v + 4 <= NV; v += 4)
        store_i8_x4(codes + v * W, VLOAD(x + v * W), VLOAD(x + (v + 1) * W), VLOAD(x + (v + 2) * W),
                    VLOAD(x + (v + 3) * W), inv);
    for (; v < NV; v++) store_i8(codes + v * W, VMAX(VSET(-127.0f), VMUL(VLOAD(x + v * W), inv)));
}

static inline __attribute__((always_inline)) void head_f32_nv(const int NV, float *restrict s,
                                                                const float *restrict alpha,
                                                                const float *restrict kk, const float *restrict qq,
                                                                const float *restrict vv, float beta,
                                                                float *restrict oo, int dk) {
    vf acc[8], out[8];
    for (int v = 0; v < NV; v++) acc[v] = VZERO();
    for (int r = 0; r < dk; r++) {
        const vf c = VSET(alpha[r] * kk[r]);
        const float *row = s + (long)r * NV * W;
        for (int l = 0; l < 4 * NV * W; l += 64) _mm_prefetch((const char *)row + AHEAD + l, _MM_HINT_T1);
        for (int v = 0; v < NV; v++) acc[v] = VFMA(c, VLOAD(row + v * W), acc[v]);
    }
    const vf vb = VSET(beta);
    for (int v = 0; v < NV; v++) {
        acc[v] = VMUL(vb, _mm512_sub_ps(VLOAD(vv + v * W), acc[v]));  // delta
        out[v] = VZERO();
    }
    for (int r = 0; r < dk; r++) {
        const vf va = VSET(alpha[r]), vk = VSET(kk[r]), vq = VSET(qq[r]);
        float *row = s + (long)r * NV * W;
        for (int v = 0; v < NV; v++) {
            const vf x = VFMA(vk, acc[v], VMUL(va, VLOAD(row + v * W)));
            VSTORE(row + v * W, x);
            out[v] = VFMA(vq, x, out[v]);
        }
    }
    for (int v = 0; v < NV; v++) VSTORE(oo + v * W, out[v]);
}

// Rows whose codes wait for their new scales, encoded GROUP at a time: each int8 row's updated values (`x`, in
// a GROUP-row ring) and the lane-wise max |x| of its vectors (`vmax`), where its codes and scale go.
#define GROUP 16
typedef struct {
    float *x, *vmax;
    int8_t *codes[GROUP];
    uint16_t *scale[GROUP];
    int n;
} pending_rows;

// The float16 scales (`bits`) and their inverses of GROUP pending rows: one transposing reduction turns the GROUP
// vectors of lane maxima into one vector of row maxima (lane i = row i), so the scales are computed 16 at a time:
// the same float32 division by qmax (lane i: row i's), the same 2^-24 floor, the same float16 rounding and the same
// 1 / scale as the scalar rule (IEEE division and float16 conversion round alike in vector and scalar form), hence
// the same codes.
static inline void group_scales(const float *vmax, vf qmax, uint16_t *bits, float *inv) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    vf m[GROUP];
    for (int i = 0; i < GROUP; i++) m[i] = VLOAD(vmax + i * W);  // rows past the pending ones: stale, unused
    for (int n = GROUP / 2; n >= 1; n /= 2)  // pairs of vectors to one: lanes (2l, 2l + 1) of each to lane l
        for (int i = 0; i < n; i++)
            m[i] = VMAX(_mm512_permutex2var_ps(m[2 * i], even, m[2 * i + 1]),
                        _mm512_permutex2var_ps(m[2 * i], odd, m[2 * i + 1]));
    const vf sc = VMAX(VSET(0x1p-24f), _mm512_div_ps(m[0], qmax));  // NaN stays NaN, as `sc < 2^-24`
    const __m256i half = _mm512_cvtps_ph(sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256((__m256i *)bits, half);
    VSTORE(inv, _mm512_div_ps(VSET(1.0f), _mm512_cvtph_ps(half)));
}

// the pending rows' scales and codes
static inline __attribute__((always_inline)) void encode_pending(const int NV, pending_rows *p) {
    uint16_t bits[GROUP];
    float inv[GROUP];
    group_scales(p->vmax, VSET(127.0f), bits, inv);
    for (int i = 0; i < p->n; i++) {
        *p->scale[i] = bits[i];
        encode_lo_nv(NV, p->codes[i], p->x + (long)i * NV * W, VSET(inv[i]));
    }
    p->n = 0;
}

// One head on DAMP storage, with S^T k, delta and the output in vector registers. Each pass decodes the stored
// rows itself: keeping pass 1's decoded rows for pass 2 (64 KB a head at 128 x 128) was measured slower, since the
// buffer spills the L1 cache. `scratch` holds the pending rows' values (GROUP * dv floats) and maxima (GROUP * W).
static inline __attribute__((always_inline)) void head_mixed_nv(
    const int NV, long b, const int32_t *restrict slot, int n_hi, int n_lo, uint16_t *restrict hi,
    int8_t *restrict lo, uint16_t *restrict lo_scale, const float *restrict alpha, const float *restrict kk,
    const float *restrict qq, const float *restrict vv, float beta, float *restrict oo, float *restrict scratch,
    int dk) {
    const int dv = NV * W;
    vf acc[8], out[8];
    for (int v = 0; v < NV; v++) acc[v] = VZERO();
    for (int r = 0; r < dk; r++) {  // S^T k of the decayed state, read straight from the storage
        const float ak = alpha[r] * kk[r];
        const int32_t sl = slot[r];
        if (sl >= 0) {
            const uint16_t *row = hi + (b * n_hi + sl) * (long)dv;
            const vf c = VSET(ak);
            for (int l = 0; l < 2 * NV * W; l += 64) _mm_prefetch((const char *)row + AHEAD + l, _MM_HINT_T1);
            for (int v = 0; v < NV; v++) acc[v] = VFMA(c, load_f16(row + v * W), acc[v]);
        } else {
            const long li = b * n_lo + (-sl - 1);
            const int8_t *row = lo + li * (long)dv;
            const vf c = VSET(ak * half_bits_to_float(lo_scale[li]));
            for (int l = 0; l < NV * W; l += 64) _mm_prefetch((const char *)row + AHEAD + l, _MM_HINT_T1);
            for (int v = 0; v < NV; v++) acc[v] = VFMA(c, load_i8(row + v * W), acc[v]);
        }
    }
    const vf vb = VSET(beta);
    for (int v = 0; v < NV; v++) {
        acc[v] = VMUL(vb, _mm512_sub_ps(VLOAD(vv + v * W), acc[v]));  // delta
        out[v] = VZERO();
    }
    // Decay + rank-1 update + output, row by row. An int8 row's codes wait for its new scale (max |x|, two
    // divisions, a float16 rounding: a long dependency chain), so they are encoded GROUP rows at a time.
    pending_rows p = {.x = scratch, .vmax = scratch + GROUP * dv, .n = 0};
    for (int r = 0; r < dk; r++) {
        const vf vk = VSET(kk[r]), vq = VSET(qq[r]);
        const int32_t sl = slot[r];
        if (sl >= 0) {
            uint16_t *row = hi + (b * n_hi + sl) * (long)dv;
            const vf va = VSET(alpha[r]);
            for (int v = 0; v < NV; v++) {
                const vf x = VFMA(vk, acc[v], VMUL(va, load_f16(row + v * W)));
                store_f16(row + v * W, x);
                out[v] = VFMA(vq, x, out[v]);
            }
        } else {
            const long li = b * n_lo + (-sl - 1);
            int8_t *codes = lo + li * (long)dv;
            float *x = p.x + (long)p.n * dv;
            const vf vc = VSET(alpha[r] * half_bits_to_float(lo_scale[li]));
            vf vmax = VZERO();
            for (int v = 0; v < NV; v++) {
                const vf xv = VFMA(vk, acc[v], VMUL(vc, load_i8(codes + v * W)));
                VSTORE(x + v * W, xv);
                out[v] = VFMA(vq, xv, out[v]);
                vmax = _mm512_range_ps(vmax, xv, 0x0B);  // max(|vmax|, |x|): one instruction for abs + max
            }
            VSTORE(p.vmax + p.n * W, vmax);
            p.codes[p.n] = codes;
            p.scale[p.n] = lo_scale + li;
            if (++p.n == GROUP) encode_pending(NV, &p);
        }
    }
    if (p.n) encode_pending(NV, &p);
    for (int v = 0; v < NV; v++) VSTORE(oo + v * W, out[v]);
}

// the floats head_mixed_nv needs as scratch
#define MIXED_NV_SCRATCH(dk, dv) (GROUP * (size_t)(dv) + GROUP * W)

#define NV_CASES(CALL) \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break;
#define REGISTER_NV(dv) ((dv) % W == 0 && (dv) <= 8 * W ? (dv) / W : 0)
#else
#define REGISTER_NV(dv) 0
#define MIXED_NV_SCRATCH(dk, dv) 0
#endif

// n floats, 64-byte aligned (whole cache lines for the vector loads and stores), or NULL
static float *scratch(size_t n) { return (float *)aligned_alloc(64, (sizeof(float) * n + 63) / 64 * 64); }

int accel_state_simd_width(void) { return W; }

// One (batch, head) pair of a step, as every kernel's head function gets it.
typedef struct {
    long b, h, bh;
    const float *k, *q, *v;  // this head's k, q [dk] and v [dv]
    float beta;
    float *o;                // its output [dv]
    const float *alpha;      // its decays [dk]
    float *mem;              // the kernel's scratch, 64-byte aligned
} head_job;

typedef void (*head_fn)(const head_job *job, const void *kernel);

// Runs `fn` on every (b, h) pair, in parallel with OpenMP (no global side effect on the thread count); each
// thread has its own decays and `scratch_floats` of scratch. -1 if a thread could not allocate them.
static int for_each_head(int B, int H, int dk, int dv, int kda, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, float *o, size_t scratch_floats, int threads,
                         head_fn fn, const void *kernel) {
    const int nt = threads > 0 ? threads : omp_get_max_threads();
    const size_t dk16 = ((size_t)dk + 15) / 16 * 16;  // the decays, rounded up to whole cache lines
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        float *mem = scratch(dk16 + scratch_floats);
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long bh = 0; bh < (long)B * H; bh++) {
            if (!mem) continue;
            decays(mem, g, kda, bh, dk);
            const head_job job = {bh / H, bh % H, bh, k + bh * dk, q + bh * dk, v + bh * dv, beta[bh], o + bh * dv,
                                  mem, mem + dk16};
            fn(&job, kernel);
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

typedef struct {
    float *S;
    int dk, dv, nv;
} f32_kernel;

static void f32_head(const head_job *j, const void *kernel) {
    const f32_kernel *K = kernel;
    const int dk = K->dk, dv = K->dv;
    float *s = K->S + j->bh * (long)dk * dv, *mem = j->mem;
#if W == 16
    if (K->nv) {
#define F32_NV(N) head_f32_nv(N, s, j->alpha, j->k, j->q, j->v, j->beta, j->o, dk)
        switch (K->nv) { NV_CASES(F32_NV) }
        return;
    }
#endif
    memset(mem, 0, sizeof(float) * (size_t)dv);
    for (int r = 0; r < dk; r++) dot_f32(s + (long)r * dv, j->alpha[r] * j->k[r], mem, dv);
    delta_rule(mem, j->v, j->beta, j->o, dv);
    for (int r = 0; r < dk; r++) update_f32(s + (long)r * dv, j->alpha[r], j->k[r], mem, j->q[r], j->o, dv);
}

int accel_state_step_f32(int B, int H, int dk, int dv, int kda, float *S, const float *q, const float *k,
                         const float *v, const float *g, const float *beta, float *o, int threads) {
    const f32_kernel kernel = {S, dk, dv, REGISTER_NV(dv)};
    return for_each_head(B, H, dk, dv, kda, q, k, v, g, beta, o, (size_t)dv, threads, f32_head, &kernel);
}

typedef struct {
    const int32_t *slot;
    int n_hi, n_lo;
    uint16_t *hi;
    int8_t *lo;
    uint16_t *lo_scale;
    int dk, dv, nv;
} mixed_kernel;

// scratch: S^T k and the int8 row buffer (dv floats each), then the register path's
static void mixed_head(const head_job *j, const void *kernel) {
    const mixed_kernel *K = kernel;
    const int dk = K->dk, dv = K->dv, n_hi = K->n_hi, n_lo = K->n_lo;
    const long b = j->b;
    const int32_t *slot = K->slot + j->h * dk;
    uint16_t *hi = K->hi, *lo_scale = K->lo_scale;
    int8_t *lo = K->lo;
    const float *alpha = j->alpha, *kk = j->k, *qq = j->q;
    float *mem = j->mem, *buf = j->mem + dv, *oo = j->o;
#if W == 16
    if (K->nv) {
#define MIXED_NV(N) head_mixed_nv(N, b, slot, n_hi, n_lo, hi, lo, lo_scale, alpha, kk, qq, j->v, j->beta, oo, \
                                  mem + 2 * (size_t)dv, dk)
        switch (K->nv) { NV_CASES(MIXED_NV) }
        return;
    }
#endif
    memset(mem, 0, sizeof(float) * (size_t)dv);
    for (int r = 0; r < dk; r++) {  // S^T k of the decayed state, read straight from the storage
        const float ak = alpha[r] * kk[r];
        const int32_t sl = slot[r];
        if (sl >= 0) {
            dot_hi(hi + (b * n_hi + sl) * (long)dv, ak, mem, dv);
        } else {
            const long li = b * n_lo + (-sl - 1);
            dot_lo(lo + li * (long)dv, ak * half_bits_to_float(lo_scale[li]), mem, dv);
        }
    }
    delta_rule(mem, j->v, j->beta, oo, dv);
    for (int r = 0; r < dk; r++) {  // decay + rank-1 update + output, encoded back row by row
        const float a = alpha[r];
        const int32_t sl = slot[r];
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

int accel_state_step_mixed(int B, int H, int dk, int dv, int kda, const int32_t *slot, int n_hi, int n_lo,
                           uint16_t *hi, int8_t *lo, uint16_t *lo_scale, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, float *o, int threads) {
    const mixed_kernel kernel = {slot, n_hi, n_lo, hi, lo, lo_scale, dk, dv, REGISTER_NV(dv)};
    const size_t floats = 2 * (size_t)dv + (kernel.nv ? MIXED_NV_SCRATCH(dk, dv) : 0);
    return for_each_head(B, H, dk, dv, kda, q, k, v, g, beta, o, floats, threads, mixed_head, &kernel);
}

// ---------------------------------------------------------------------------------------------------------------
// accel_state_step_water: the same step on a water-filled DAMP map, where every channel has its own INT-K width
// (K = 2..16): symmetric codes on 2^K - 1 levels (qmax = 2^(K-1) - 1), one float16 scale a row (absmax / qmax, at
// least 2^-24), codes stored as K-bit two's complement fields of a little-endian bit stream, value i at bits
// [iK, (i + 1)K) of its row (K = 8: the code's own byte) — the runtime's storage
// (accel.runtime.state_cache, `StateScheme(row_formats=...)`): per width one stream of the rows of that width
// (batch-major), d_v * K / 8 bytes a row. width[h * dk + r] is row r's K, slot[h * dk + r] its index among the
// rows of its width, n_rows[K] their count (per batch element), codes[K] / scales[K] the width's stream.

typedef struct {  // a row of width K: field = code mod 2^K, code = the field sign-extended from bit K - 1
    int k, row_bytes;
    int32_t qmax;
} width_rule;

static inline width_rule rule_of(int k, int dv) {
    width_rule w = {k, dv * k / 8, (1 << (k - 1)) - 1};
    return w;
}

// A row's K-bit fields (value i at bits [iK, iK + K) of the little-endian stream; d_v * K a multiple of 8, so a row
// is whole bytes) through a 64-bit accumulator.
static void unpack_row(const uint8_t *p, width_rule w, int dv, float *out) {
    uint64_t acc = 0;
    int nb = 0;
    const uint32_t mask = (1u << w.k) - 1;
    for (int i = 0; i < dv; i++) {
        for (; nb < w.k; nb += 8) acc |= (uint64_t)*p++ << nb;
        out[i] = (float)((int32_t)(((uint32_t)acc & mask) << (32 - w.k)) >> (32 - w.k));
        acc >>= w.k;
        nb -= w.k;
    }
}

// codes = clamp(round-half-even(x * inv), -qmax, qmax), written as fields
static void pack_row(uint8_t *o, width_rule w, int dv, const float *x, float inv) {
    uint64_t acc = 0;
    int nb = 0;
    for (int i = 0; i < dv; i++) {
        float c = round_even(x[i] * inv);
        c = c > (float)w.qmax ? (float)w.qmax : (c < (float)-w.qmax ? (float)-w.qmax : c);
        acc |= (uint64_t)((uint32_t)(int32_t)c & ((1u << w.k) - 1)) << nb;
        nb += w.k;
        for (; nb >= 8; nb -= 8, acc >>= 8) *o++ = (uint8_t)acc;
    }
}

#if W == 16 && defined(__AVX512VBMI__)
// --- vector path (AVX-512 VBMI, d_v = 16..128 in steps of 16): a block of 16 values of a K-bit row is 2K bytes.
typedef struct {
    __m512i unpack_idx, unpack_lift;   // per value: its 4 bytes from the block, then 32 - K - its bit offset
    __m512i pack_shift, idx_a, idx_b;  // the packing of 16 fields into 2K bytes (see pack16)
    __mmask64 mask_a, mask_b, block;   // the bytes each half of the packing writes; the block's 2K bytes
    __m512i idx_a2, idx_b2;            // the same for two blocks at once (4K bytes, the second from `quad1`)
    __mmask64 mask_a2, mask_b2, block2;
    __m512i field, sign_shift;  // 2^K - 1; 32 - K (the arithmetic shift that sign-extends a lifted field)
    __m512 qmax;
    __m512i pair_shift, quad_shift;  // 32 - K and 2K in every qword (per-lane shifts: no port-5 uop)
} width_tables;

static void make_tables(width_tables *t, width_rule w) {
    const int k = w.k;
    uint8_t ui[64], ia[64] = {0}, ib[64] = {0};
    int32_t us[16];
    for (int i = 0; i < 16; i++) {
        for (int j = 0; j < 4; j++) ui[4 * i + j] = (uint8_t)(((i * k) >> 3) + j);
        us[i] = 32 - k - ((i * k) & 7);
    }
    t->unpack_idx = _mm512_loadu_si512(ui);
    t->unpack_lift = _mm512_loadu_si512(us);
    // after pairing, qword 2L of the packed vector holds fields 4L..4L+3 (4K bits); it starts at bit 4K * L of the
    // block, so lanes 1 and 3 are first shifted by (4K mod 8) and the bytes of lanes 0, 2 and of lanes 1, 3 are
    // gathered separately (a byte where two lanes meet gets a nibble from each) and or-ed
    const int sh = (4 * k) & 7;
    t->pack_shift = _mm512_setr_epi64(0, 0, sh, 0, 0, 0, sh, 0);
    t->mask_a = t->mask_b = 0;
    for (int lane = 0; lane < 4; lane++) {
        const int start = (4 * k * lane) >> 3, bits = 4 * k + ((lane & 1) ? sh : 0), n = (bits + 7) >> 3;
        for (int j = 0; j < n; j++) {
            if (lane & 1) {
                ib[start + j] = (uint8_t)(16 * lane + j);
                t->mask_b |= 1ULL << (start + j);
            } else {
                ia[start + j] = (uint8_t)(16 * lane + j);
                t->mask_a |= 1ULL << (start + j);
            }
        }
    }
    t->idx_a = _mm512_loadu_si512(ia);
    t->idx_b = _mm512_loadu_si512(ib);
    t->block = (1ULL << (2 * k)) - 1;  // 2K <= 32 bytes
    uint8_t ia2[64], ib2[64];
    for (int j = 0; j < 64; j++) {  // bytes 2K.. come from the second block's lanes: indices 64.. of the pair
        ia2[j] = j < 2 * k ? ia[j] : (j < 4 * k ? (uint8_t)(64 + ia[j - 2 * k]) : 0);
        ib2[j] = j < 2 * k ? ib[j] : (j < 4 * k ? (uint8_t)(64 + ib[j - 2 * k]) : 0);
    }
    t->idx_a2 = _mm512_loadu_si512(ia2);
    t->idx_b2 = _mm512_loadu_si512(ib2);
    t->mask_a2 = t->mask_a | (t->mask_a << (2 * k));
    t->mask_b2 = t->mask_b | (t->mask_b << (2 * k));
    t->block2 = 4 * k == 64 ? ~0ULL : (1ULL << (4 * k)) - 1;
    t->field = _mm512_set1_epi32((1 << k) - 1);
    t->sign_shift = _mm512_set1_epi32(32 - k);
    t->qmax = _mm512_set1_ps((float)w.qmax);
    t->pair_shift = _mm512_set1_epi64(32 - k);
    t->quad_shift = _mm512_set1_epi64(2 * k);
}

// the 16 codes of a block, as float
static inline vf unpack16(const uint8_t *p, const width_tables *t) {
    const __m512i f = _mm512_permutexvar_epi8(t->unpack_idx, _mm512_maskz_loadu_epi8(t->block, p));
    return _mm512_cvtepi32_ps(_mm512_srav_epi32(_mm512_sllv_epi32(f, t->unpack_lift), t->sign_shift));
}

// codes = clamp(round-half-even(x * inv), -qmax, qmax) of 16 values as K-bit fields, gathered by fours: qword 2L of
// the result holds fields 4L..4L+3 (4K bits), shifted left by (4K mod 8) in lanes 1 and 3 (see make_tables)
static inline __m512i quad16(vf x, vf inv, const width_tables *t) {
    // clamped to +-qmax before rounding (vrangeps 0x02: the smaller magnitude with x's sign), the same as after it:
    // qmax is a whole number and rounding half to even is monotone and odd
    const __m512i c = _mm512_cvtps_epi32(_mm512_range_ps(VMUL(x, inv), t->qmax, 0x02));
    const __m512i f = _mm512_and_si512(c, t->field);  // fields, K bits each
    // pairs of fields to qwords: f[2j] | f[2j + 1] << K (the high dword shifted down by 32 - K; K <= 16)
    const __m512i pair = _mm512_ternarylogic_epi64(f, _mm512_set1_epi64(0xFFFFFFFF),
                                                   _mm512_srlv_epi64(f, t->pair_shift), 0xEA);  // (a & b) | c
    // pairs of qwords within each 128-bit lane: qword 2L = fields 4L..4L+3
    const __m512i quad = _mm512_or_si512(pair, _mm512_sllv_epi64(_mm512_bsrli_epi128(pair, 8), t->quad_shift));
    return _mm512_sllv_epi64(quad, t->pack_shift);
}

// the 2K bytes of one block
static inline void pack16(uint8_t *p, vf x, vf inv, const width_tables *t) {
    const __m512i quad = quad16(x, inv, t);
    const __m512i bytes = _mm512_or_si512(_mm512_maskz_permutexvar_epi8(t->mask_a, t->idx_a, quad),
                                          _mm512_maskz_permutexvar_epi8(t->mask_b, t->idx_b, quad));
    _mm512_mask_storeu_epi8(p, t->block, bytes);
}

// the 4K bytes of two consecutive blocks: one two-source gather per half and one store
static inline void pack32(uint8_t *p, vf x0, vf x1, vf inv, const width_tables *t) {
    const __m512i q0 = quad16(x0, inv, t), q1 = quad16(x1, inv, t);
    const __m512i bytes = _mm512_or_si512(_mm512_maskz_permutex2var_epi8(t->mask_a2, q0, t->idx_a2, q1),
                                          _mm512_maskz_permutex2var_epi8(t->mask_b2, q0, t->idx_b2, q1));
    _mm512_mask_storeu_epi8(p, t->block2, bytes);
}

typedef struct {
    float *x, *vmax;
    uint8_t *codes[GROUP];
    uint16_t *scale[GROUP];
    int k[GROUP];
    float qmax[GROUP];
    int n;
} pending_water;

// the pending rows' scales and codes, each row with its own width and qmax
static inline __attribute__((always_inline)) void encode_pending_water(const int NV, pending_water *p,
                                                                         const width_tables *tables) {
    uint16_t bits[GROUP];
    float inv[GROUP];
    group_scales(p->vmax, VLOAD(p->qmax), bits, inv);
    for (int i = 0; i < p->n; i++) {
        const width_tables *t = tables + p->k[i];
        const float *x = p->x + (long)i * NV * W;
        const vf vi = VSET(inv[i]);
        *p->scale[i] = bits[i];
        int v = 0;
        for (; v + 2 <= NV; v += 2)
            pack32(p->codes[i] + v * 2 * p->k[i], VLOAD(x + v * W), VLOAD(x + (v + 1) * W), vi, t);
        if (v < NV) pack16(p->codes[i] + v * 2 * p->k[i], VLOAD(x + v * W), vi, t);
    }
    p->n = 0;
}

static inline __attribute__((always_inline)) void head_water_nv(
    const int NV, long b, const int32_t *restrict slot, const uint8_t *restrict width, const int32_t *n_rows,
    uint8_t *const *codes, uint16_t *const *scales, const width_tables *tables, const float *restrict alpha,
    const float *restrict kk, const float *restrict qq, const float *restrict vv, float beta, float *restrict oo,
    float *restrict scratch, int dk) {
    const int dv = NV * W;
    vf acc[8], out[8];
    for (int v = 0; v < NV; v++) acc[v] = VZERO();
    for (int r = 0; r < dk; r++) {  // S^T k of the decayed state, read straight from the codes
        const int k = width[r];
        const long li = b * n_rows[k] + slot[r];
        const uint8_t *row = codes[k] + li * (dv * k / 8);
        const width_tables *t = tables + k;
        for (int l = 0; l < dv * k / 8; l += 64) _mm_prefetch((const char *)row + AHEAD + l, _MM_HINT_T1);
        const vf c = VSET(alpha[r] * kk[r] * half_bits_to_float(scales[k][li]));
        for (int v = 0; v < NV; v++) acc[v] = VFMA(c, unpack16(row + v * 2 * k, t), acc[v]);
    }
    const vf vb = VSET(beta);
    for (int v = 0; v < NV; v++) {
        acc[v] = VMUL(vb, _mm512_sub_ps(VLOAD(vv + v * W), acc[v]));  // delta
        out[v] = VZERO();
    }
    pending_water p = {.x = scratch, .vmax = scratch + GROUP * dv, .n = 0};
    for (int r = 0; r < dk; r++) {  // decay + rank-1 update + output; codes encoded GROUP rows at a time
        const int k = width[r];
        const long li = b * n_rows[k] + slot[r];
        uint8_t *row = codes[k] + li * (dv * k / 8);
        const width_tables *t = tables + k;
        const vf vk = VSET(kk[r]), vq = VSET(qq[r]), vc = VSET(alpha[r] * half_bits_to_float(scales[k][li]));
        float *x = p.x + (long)p.n * dv;
        vf vmax = VZERO();
        for (int v = 0; v < NV; v++) {
            const vf xv = VFMA(vk, acc[v], VMUL(vc, unpack16(row + v * 2 * k, t)));
            VSTORE(x + v * W, xv);
            out[v] = VFMA(vq, xv, out[v]);
            vmax = _mm512_range_ps(vmax, xv, 0x0B);
        }
        VSTORE(p.vmax + p.n * W, vmax);
        p.codes[p.n] = row;
        p.scale[p.n] = scales[k] + li;
        p.k[p.n] = k;
        p.qmax[p.n] = (float)((1 << (k - 1)) - 1);
        if (++p.n == GROUP) encode_pending_water(NV, &p, tables);
    }
    if (p.n) encode_pending_water(NV, &p, tables);
    for (int v = 0; v < NV; v++) VSTORE(oo + v * W, out[v]);
}
#define WATER_NV(dv) REGISTER_NV(dv)
#else
#define WATER_NV(dv) ((void)(dv), 0)
#endif

int accel_state_water_vector_path(int dv) { return WATER_NV(dv) != 0; }

// Its own parallel loop rather than for_each_head: through the head-function pointer the vector path measured 7-10%
// slower (0.29 -> 0.32 ms a Qwen3-Next layer, side by side; moving the packing constants into registers did not
// recover it), where the float32 and two-tier kernels measured the same either way.
int accel_state_step_water(int B, int H, int dk, int dv, int kda, const int32_t *slot, const uint8_t *width,
                           const int32_t *n_rows, uint8_t *const *codes, uint16_t *const *scales, const float *q,
                           const float *k, const float *v, const float *g, const float *beta, float *o,
                           int threads) {
    const int nt = threads > 0 ? threads : omp_get_max_threads();  // no global side effect
    if (dv % 8) return -2;  // rows of d_v * K bits are whole bytes only for d_v a multiple of 8
    for (int i = 0; i < H * dk; i++)
        if (width[i] < 2 || width[i] > 16) return -2;
    const int nv = WATER_NV(dv);
    const size_t dk16 = ((size_t)dk + 15) / 16 * 16;
#if W == 16 && defined(__AVX512VBMI__)
    width_tables tables[17];
    for (int kk = 2; kk <= 16; kk++) make_tables(tables + kk, rule_of(kk, dv));
#endif
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        // S^T k, the row buffer, the decays (rounded up to whole cache lines), and the vector path's scratch
        float *mem = scratch(2 * (size_t)dv + dk16 + (nv ? MIXED_NV_SCRATCH(dk, dv) : 0));
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
#if W == 16 && defined(__AVX512VBMI__)
            if (nv) {
#define WATER_CALL(N) head_water_nv(N, b, slot + h * dk, width + h * dk, n_rows, codes, scales, tables, alpha, kk, \
                                    qq, v + bh * dv, beta[bh], oo, mem + 2 * (size_t)dv + dk16, dk)
                switch (nv) { NV_CASES(WATER_CALL) }
                continue;
            }
#endif
            // generic (scalar): each row decoded into buf
            memset(mem, 0, sizeof(float) * (size_t)dv);
            for (int r = 0; r < dk; r++) {
                const width_rule w = rule_of(width[h * dk + r], dv);
                const long li = b * n_rows[w.k] + slot[h * dk + r];
                unpack_row(codes[w.k] + li * w.row_bytes, w, dv, buf);
                const float c = alpha[r] * kk[r] * half_bits_to_float(scales[w.k][li]);
                for (int j = 0; j < dv; j++) mem[j] = fmaf(c, buf[j], mem[j]);
            }
            delta_rule(mem, v + bh * dv, beta[bh], oo, dv);
            for (int r = 0; r < dk; r++) {
                const width_rule w = rule_of(width[h * dk + r], dv);
                const long li = b * n_rows[w.k] + slot[h * dk + r];
                uint8_t *row = codes[w.k] + li * w.row_bytes;
                unpack_row(row, w, dv, buf);
                float amax = 0.0f;
                const float c = alpha[r] * half_bits_to_float(scales[w.k][li]), kr = kk[r], qr = qq[r];
                for (int j = 0; j < dv; j++) {  // fused as in the vector path, so both give the same bits
                    buf[j] = fmaf(kr, mem[j], c * buf[j]);
                    oo[j] = fmaf(qr, buf[j], oo[j]);
                    const float ax = fabsf(buf[j]);
                    amax = ax > amax ? ax : amax;
                }
                float sc = amax / (float)w.qmax;
                if (sc < 0x1p-24f) sc = 0x1p-24f;
                scales[w.k][li] = float_to_half_bits(sc);
                pack_row(row, w, dv, buf, 1.0f / half_bits_to_float(scales[w.k][li]));
            }
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// The runtime's INT-K row storage on its own (accel.runtime.state_cache's encode_rows / decode_rows for K = 2..16,
// K != 8), the same bits: n rows of dv values (dv * K a multiple of 8) <-> one bit stream of K-bit two's complement
// codes and a float16 scale a row (absmax / qmax, at least 2^-24; codes round-half-even(x * (1 / scale)) clamped to +-qmax).
// The cache calls these for every store and load of a decode step; numpy's bit packing took 10-30 ns a value.

int accel_state_encode_int_rows(const float *x, long n, int dv, int k, uint8_t *codes, uint16_t *scales,
                                int threads) {
    if (k < 2 || k > 16 || k == 8 || (dv * k) % 8) return -1;
    const width_rule w = rule_of(k, dv);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * dv > (1 << 16))
    for (long r = 0; r < n; r++) {
        const float *row = x + r * dv;
        float amax = 0.0f;
        for (int j = 0; j < dv; j++) {
            const float a = fabsf(row[j]);
            amax = a > amax ? a : amax;
        }
        float sc = amax / (float)w.qmax;
        if (sc < 0x1p-24f) sc = 0x1p-24f;
        scales[r] = float_to_half_bits(sc);
        pack_row(codes + r * w.row_bytes, w, dv, row, 1.0f / half_bits_to_float(scales[r]));
    }
    return 0;
}

int accel_state_decode_int_rows(const uint8_t *codes, const uint16_t *scales, long n, int dv, int k, float *out,
                                int threads) {
    if (k < 2 || k > 16 || k == 8 || (dv * k) % 8) return -1;
    const width_rule w = rule_of(k, dv);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * dv > (1 << 16))
    for (long r = 0; r < n; r++) {
        float *o = out + r * dv;
        unpack_row(codes + r * w.row_bytes, w, dv, o);
        const float s = half_bits_to_float(scales[r]);
        for (int j = 0; j < dv; j++) o[j] *= s;
    }
    return 0;
}
