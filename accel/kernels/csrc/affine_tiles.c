/* affine 8-, 4- and 2-bit codes in 16-row tiles (VNNI, AVX2).
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
/* The affine tiles on AVX2. 4- and 2-bit codes: the same tile copy and the same input digits as the VNNI tiles,
 * read half a tile (8 rows, 32 bytes of a step) at a time: vpmaddubsw multiplies the code bytes (unsigned) by the
 * broadcast digit bytes (signed) and adds them in pairs into 16-bit lanes, vpaddw sums W steps of those for all the
 * fields of a byte (exact: |a step's sum| <= per * 2 * (2^bits - 1) * 128, W of them below 2^15), and vpmaddwd by
 * ones widens a row's two lanes into its int32 sum. 8-bit codes (a pair of their products, up to 2 * 255 * 128,
 * would overflow vpmaddubsw's 16-bit sums): the codes widened to 16 bits, times the input in two 16-bit pieces
 * X = 65536 Xh + Xl by vpmaddwd straight into int32 lanes (tiled_tile_avx2_8). */

/* 8-bit codes: the input of block g as 16-bit pieces, X = round(x 2^e_g) = 65536 Xh + Xl (Xl the low 16 bits,
 * signed; |Xh| <= 64), 16 bytes a step: xd[4 k ..] = Xl of columns 4k .. 4k+3, then their Xh (vpackssdw of the two
 * pieces puts them so, 8 columns a vector, without saturating). unit[g] and gsum[g] as tiled_block_input_t's. A
 * block ends on a step (bw is a multiple of 4), so a vector whose last 4 columns lie past c1 writes its first step
 * only: the next block's is another thread's. */
static int tiled_block_input8(const Tiled *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t g) {
    const int64_t c0 = g * a->bw, c1 = c0 + a->bw < a->cols ? c0 + a->bw : a->cols;
    float fac;
    if (!block_scale8(x, c0, c1, &fac, &unit[g])) return 0;
    const __m256 vfac = _mm256_set1_ps(fac);
    __m256i vsum = _mm256_setzero_si256(); /* |X| < 2^22, 16 a lane: exact */
    for (int64_t c = c0; c < c1; c += 8) {
        const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_maskload_ps(x + c, lanes8(c1 - c)), vfac));
        vsum = _mm256_add_epi32(vsum, X);
        const __m256i lo = _mm256_srai_epi32(_mm256_slli_epi32(X, 16), 16);
        const __m256i hi = _mm256_srai_epi32(_mm256_sub_epi32(X, lo), 16); /* exact: a multiple of 65536 */
        const __m256i both = _mm256_packs_epi32(lo, hi);
        if (c1 - c > 4) _mm256_storeu_si256((__m256i *)(xd + c), both);
        else _mm_storeu_si128((__m128i *)(xd + c), _mm256_castsi256_si128(both));
    }
    gsum[g] = (float)((double)hsum8_epi32(vsum) * (double)unit[g]);
    return 1;
}

/* the input digits of block g (see tiled_block_input_t): 8 columns a vector, then the bytes of 16 columns into their
 * dword order (step, field) by one shuffle a piece. A block is whole steps (bw is a multiple of 4 per), and the bytes
 * of a last step's columns past the matrix's end are zero. 8-bit codes: tiled_block_input8. */
static int tiled_block_input(const Tiled *a, const float *x, int32_t *xd, float *unit, float *gsum, int64_t g) {
    if (a->bits == 8) return tiled_block_input8(a, x, xd, unit, gsum, g);
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

/* the steps [*k0, *k1) of input block blk, and the group it lies in */
AI int64_t tiled_block(const Tiled *a, int64_t blk, int64_t *k0, int64_t *k1) {
    *k0 = blk * a->bsteps;
    *k1 = *k0 + a->bsteps < a->steps ? *k0 + a->bsteps : a->steps;
    return a->ngroups == 1 ? 0 : blk / (a->group / a->bw);
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
    for (int64_t blk = 0; blk < a->nblocks; blk++) {
        int64_t k0, k1;
        const int64_t g = tiled_block(a, blk, &k0, &k1);
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

/* 8-bit codes: the 16 rows of tile t as four quarters of 4 rows (16 code bytes of a step, widened to 16 bits):
 * vpmaddwd by the step's broadcast pieces gives a row's two int32 lanes (columns 4k, 4k+1 and 4k+2, 4k+3), summed
 * over the block (|lane| <= 2 bsteps * 255 * 32768 < 2^30 for bsteps <= 32), then a row's two lanes by vphaddd
 * (< 2^31) and the rows into order by one permute. */
AI void tiled_tile_avx2_8(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum,
                          float *y, const uint8_t *next) {
    const uint8_t *base = a->tiles + t * a->steps * 64;
    const int64_t ahead = next ? next - base : 0;
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    const float mid = 0.5f * (float)(a->levels - 1);
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, total_off[2] = {total[0], total[0]};
    for (int64_t blk = 0; blk < a->nblocks; blk++) {
        int64_t k0, k1;
        const int64_t g = tiled_block(a, blk, &k0, &k1);
        __m256i lo[4], hi[4];
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k++) {
            prefetch_line(base + k * 64, ahead);
            int64_t pieces[2];
            memcpy(pieces, xd + 4 * k, sizeof pieces);
            const __m256i xl = _mm256_set1_epi64x(pieces[0]), xh = _mm256_set1_epi64x(pieces[1]);
            for (int j = 0; j < 4; j++) {
                const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(base + k * 64 + 16 * j)));
                madd_add(&lo[j], q, xl);
                madd_add(&hi[j], q, xh);
            }
        }
        const int64_t side = (t * a->ngroups + g) * 16;
        for (int h = 0; h < 2; h++) {
            const __m256i L = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[2 * h], lo[2 * h + 1]), order);
            const __m256i H = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(hi[2 * h], hi[2 * h + 1]), order);
            const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(H), _mm256_set1_ps(65536.0f), _mm256_cvtepi32_ps(L));
            tiles_block_sum8(&total[h], &total_off[h], dot, unit[blk], a->scale, a->symmetric ? NULL : a->offset,
                             a->scale_f32, side + 8 * h, mid, gsum[blk]);
        }
    }
    store_tile8x2(y, t, a->rows, total, total_off);
}

static void tiled_tile(const Tiled *a, int64_t t, const int32_t *xd, const float *unit, const float *gsum, float *y,
                       const uint8_t *next) {
    if (a->bits == 8) tiled_tile_avx2_8(a, t, xd, unit, gsum, y, next);
    else if (a->bits == 4) tiled_tile_avx2_t(a, t, xd, unit, gsum, y, 2, next);
    else tiled_tile_avx2_t(a, t, xd, unit, gsum, y, 4, next);
}
#else
#define HAVE_TILES_AVX2 0
#endif

/* the code widths (bit 8, 4, 2 of the mask; bit 3: base-3) whose tile copies an integer kernel reads on this CPU */
static int tiled_kinds(void) {
    if (!g_simd) return 0;
    if (HAVE_VNNI) return 1 << 8 | 1 << 4 | 1 << 3 | 1 << 2;
    if (HAVE_TILES_AVX2) return 1 << 8 | 1 << 4 | 1 << 3 | 1 << 2;
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
        /* dwords a step: 3 pieces of each field's 4 bytes; the AVX2 8-bit tiles' two 16-bit pieces of 4 columns */
        const size_t nxd = (size_t)(a.steps + 4) * (bits == 8 && !HAVE_VNNI ? 4 : per * 3); /* + the overrun */
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
