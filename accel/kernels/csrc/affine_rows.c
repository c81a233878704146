/* affine codes a row at a time: packed b-bit streams and base-L groups.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
