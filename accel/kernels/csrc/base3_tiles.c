/* affine base-3 codes in 16-row tiles, 5 codes a byte (VNNI, AVX2).
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
