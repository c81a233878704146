/* Leech 4-plane and onehot stages in 16-row tiles: AVX-512 VNNI + GFNI, and AVX2 byte tables.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

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
