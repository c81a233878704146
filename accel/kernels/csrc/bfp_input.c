/* block floating point input for the integer tiles.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
