/* the fast Walsh-Hadamard transform and the seeded randomized Hadamard rotations (RHT).
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
