/* Leech stages (planes, onehot) a row at a time, with their lookup-table tiles.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

/* ------------------------------------------------------------------------------------------------- Leech */

enum { LEECH_PLANES = 0, LEECH_ONEHOT = 1 };

typedef struct {
    int nstages;
    const uint8_t *stream[2];
    int64_t stream_bytes[2];
    int layout[2]; /* LEECH_PLANES / LEECH_ONEHOT */
    int param[2];  /* planes: bits per coordinate; onehot: K magnitude masks */
    float alpha[2];
    const uint16_t *scale; /* fp16, one per row */
    int64_t rows, cols, nblk; /* cols padded to 24 * nblk; nblk = blocks per row */
    const uint8_t *tiled[2]; /* a 4-plane stage's 16-row tile copy (see "Leech planes, 16-row tiles"), or NULL */
} Leech;

static inline int parity_bit(const uint8_t *par, int64_t k) { return (par[k >> 3] >> (k & 7)) & 1; }

/* sum over the row's blocks of parity * zb (planes: x = 2 v + p, so p contributes p * sum of the block's z) */
static float parity_term(const uint8_t *par, int64_t parbytes, int64_t first, int64_t nblk, const float *zb) {
    float total = 0.0f;
    (void)parbytes; /* only the AVX-512 path reads words */
#if HAVE_AVX512
    if (g_simd) {
        __m512 acc = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b < nblk; b += 16) {
            int64_t left = nblk - b;
            int take = left >= 16 ? 16 : (int)left;
            __mmask16 m = (__mmask16)get_bits(par, parbytes, (uint64_t)(first + b), take);
            acc = _mm512_mask_add_ps(acc, m, acc, _mm512_maskz_loadu_ps((__mmask16)((1u << take) - 1u), zb + b));
        }
        return hsum(acc);
    }
#elif HAVE_AVX2
    if (g_simd) { /* 8 blocks a step: each parity bit spread to a lane mask (random bits: a branch mispredicts) */
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblk; b += 8) {
            const int take = nblk - b >= 8 ? 8 : (int)(nblk - b);
            const __m256i m = _mm256_set1_epi32((int)get_bits(par, parbytes, (uint64_t)(first + b), take));
            const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(m, bit), bit);
            acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_castsi256_ps(on), _mm256_maskload_ps(zb + b, lanes8(take))));
        }
        return hsum8(acc);
    }
#endif
    for (int64_t b = 0; b < nblk; b++) total += parity_bit(par, first + b) ? zb[b] : 0.0f; /* no branch */
    return total;
}

#if HAVE_AVX512
/* out[i] = the parity term of the 16 rows of a tile from its parity tile copy ([word][row] uint32, word k = blocks
 * 32 k .. 32 k + 31 of the row): nibble n of a word indexes ptab's table 8 k + n of the subset sums of zb over its 4
 * blocks (vpermps reads the low 4 bits of a lane, so a shift is the whole decode): 3 operations per 4 blocks of 16
 * rows, where parity_term takes about 10 per 16 blocks of one row. */
static void parity_tiled(const uint32_t *pt, int64_t words, const float *ptab, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < words; k++) {
        const __m512i v = _mm512_loadu_si512(pt + 16 * k);
        const float *tb = ptab + 128 * k;
        for (int n = 0; n < 8; n += 2) {
            a0 = _mm512_add_ps(a0, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * n), _mm512_loadu_ps(tb + 16 * n)));
            a1 = _mm512_add_ps(a1, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * n + 4),
                                                         _mm512_loadu_ps(tb + 16 * n + 16)));
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(a0, a1));
}
#endif

/* The spread parity of a onehot tile copy's step k (coordinates 32 k .. 32 k + 31) for the rows at row0 of its
 * parity words pw ([word][16 rows], bit b = block b): those coordinates lie in blocks b0 = 4 k / 3 and b0 + 1, the
 * first 24, 16 or 8 of them (k mod 3 = 0, 1, 2) in b0, so two bits of each row's word select two constant masks;
 * past the row the words are zero. One definition for 16 and 8 rows (GCC vector extensions on 32-bit lanes). */
#define SPREAD_PARITY(name, U)                                                                                        \
    AI U name(const uint32_t *pw, int64_t pwords, int64_t k, int row0) {                                              \
        const int64_t b0 = 4 * k / 3, w = b0 / 32;                                                                    \
        const int sh = (int)(b0 % 32);                                                                                \
        U pb = {0}, next = {0};                                                                                       \
        if (w < pwords) {                                                                                             \
            memcpy(&pb, pw + 16 * w + row0, sizeof pb);                                                               \
            pb >>= sh;                                                                                                \
        }                                                                                                             \
        if (sh == 31 && w + 1 < pwords) {                                                                             \
            memcpy(&next, pw + 16 * (w + 1) + row0, sizeof next);                                                     \
            pb |= next << 1;                                                                                          \
        }                                                                                                             \
        const uint32_t m0 = 0xffffffffu >> (8 + 8 * (k % 3));                                                         \
        return (-(pb & 1) & m0) | (-((pb >> 1) & 1) & ~m0); /* all ones where b0 (b0 + 1) is odd */                 \
    }
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#if HAVE_AVX512
SPREAD_PARITY(spread_parity16, u32x16)
#endif
#if HAVE_AVX2
SPREAD_PARITY(spread_parity8, u32x8)
#endif

/* A onehot stage is turned into planes on the fly, bit-sliced (each operation handles 32 coordinates of 16 rows):
 * with m = sum_k k [mask k], p the parity and s the sign, x = (1 - 2 s)(2 m + p) = 2 v + p for
 * v = s ? -(m + p) : m, computed as u = m + (p & s), v = (u ^ s) + s in two's complement on nb + 1 bits
 * (nb = bits of K + 1). The planes of v then go through the planes lookups; p through the parity term. */
#define ONEHOT_SLICE(T, ZERO, Mk, Pm, S, V, K, nb)                                                                     \
    do {                                                                                                           \
        T u[4], carry = (Pm) & (S);                                                                                \
        for (int q = 0; q < (nb); q++) {                                                                           \
            T mq = (ZERO);                                                                                         \
            for (int m = 1; m <= (K); m++)                                                                         \
                if ((m >> q) & 1) mq = mq | (Mk)[m - 1];                                                           \
            u[q] = mq ^ carry;                                                                                     \
            carry = mq & carry;                                                                                    \
        }                                                                                                          \
        carry = (S);                                                                                               \
        for (int q = 0; q <= (nb); q++) {                                                                          \
            T w = (q < (nb) ? u[q] : (ZERO)) ^ (S);                                                                \
            (V)[q] = w ^ carry;                                                                                    \
            carry = w & carry;                                                                                     \
        }                                                                                                          \
    } while (0)

static inline int onehot_value_bits(const int K) { return (K + 1) >= 4 ? 3 : ((K + 1) >= 2 ? 2 : 1); }

/* F(args..., K) with K a compile-time constant (the inlined kernels unroll their per-mask loops): K = 1 .. 6 */
#define ONEHOT_DISPATCH(K, F, ...)                                                                                     \
    do {                                                                                                               \
        switch (K) {                                                                                                   \
        case 6: F(__VA_ARGS__, 6); break;                                                                              \
        case 2: F(__VA_ARGS__, 2); break;                                                                              \
        case 1: F(__VA_ARGS__, 1); break;                                                                              \
        case 3: F(__VA_ARGS__, 3); break;                                                                              \
        case 4: F(__VA_ARGS__, 4); break;                                                                              \
        default: F(__VA_ARGS__, 5); break;                                                                             \
        }                                                                                                              \
    } while (0)

/* The Leech row kernels look every nibble of a plane up in a 16-entry table of the subset sums of the 4 inputs it
 * covers: tab[16 g + i] = sum of z[4 g + t] over the set bits t of i. One table serves every plane and every row. */
static void build_tables(const float *z, int64_t cols, float *tab) {
    for (int64_t g = 0; g < cols / 4; g++) {
        const float *q = z + 4 * g;
        float *t = tab + 16 * g;
        t[0] = 0.0f;
        t[1] = q[0];
        t[2] = q[1];
        t[3] = q[0] + q[1];
        t[4] = q[2];
        t[5] = q[0] + q[2];
        t[6] = q[1] + q[2];
        t[7] = t[3] + q[2];
        for (int i = 0; i < 8; i++) t[8 + i] = t[i] + q[3];
    }
}

/* a byte's contribution by table lookup (the scalar tail of a tile) */
static inline float byte_lookup(const float *tab, int64_t k, unsigned byte) {
    return tab[32 * k + (byte & 15)] + tab[32 * k + 16 + (byte >> 4)];
}

/* the scalar tail of a tile, bytes [k, rowbytes) of its nr rows at p: out[i] += their planes' (onehot: their
 * bit-sliced v's) contributions */
static void planes_tail(const uint8_t *p, int64_t plane_stride, int64_t rowbytes, int64_t k, int nr, const float *tab,
                        float *out, int bits) {
    for (; k < rowbytes; k++)
        for (int i = 0; i < nr; i++)
            for (int j = 0; j < bits; j++) {
                float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
                out[i] += w * byte_lookup(tab, k, p[i * rowbytes + j * plane_stride + k]);
            }
}

static void onehot_tail(const uint8_t *p, int64_t plane_stride, int64_t rowbytes, int64_t k, int nr,
                        const uint8_t *pm, const float *tab, float *out, int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    for (; k < rowbytes; k++)
        for (int i = 0; i < nr; i++) {
            unsigned M[6], V[4];
            for (int m = 0; m < K; m++) M[m] = p[i * rowbytes + m * plane_stride + k];
            unsigned S = p[i * rowbytes + K * plane_stride + k], P = pm[i * rowbytes + k];
            ONEHOT_SLICE(unsigned, 0u, M, P, S, V, K, nb);
            for (int j = 0; j < bits; j++) {
                float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
                out[i] += w * byte_lookup(tab, k, V[j] & 0xffu);
            }
        }
}

#if HAVE_AVX512
/* The AVX-512 Leech kernels work on tiles of 16 rows: one dword gather per plane brings 4 bytes (32 coordinates)
 * of each of the 16 rows into the 16 lanes, and vpermps looks every nibble up in the tables, so a nibble of a
 * plane costs a shift, a permute and an add for 16 rows at once. */

AI __m512i tile_offsets(int64_t rowbytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)rowbytes));
}

/* The gathers jump between 16 rows, which the hardware prefetcher does not follow, but the next tile's bytes of a
 * plane are one contiguous run of 16 rows: while this tile reads bytes [k, k + kstep) of its rows, fetch bytes
 * [16 k, 16 (k + kstep)) of that run, so the next tile arrives spread over this one. */
AI void tile_prefetch(const uint8_t *p, int64_t rowbytes, int64_t plane_stride, int planes, int64_t k, int kstep) {
    const uint8_t *next = p + 16 * rowbytes;
    for (int j = 0; j < planes; j++)
        for (int64_t off = 16 * k; off < 16 * (k + kstep); off += 64)
            _mm_prefetch((const char *)(next + j * plane_stride + off), _MM_HINT_T0);
}


/* out[lane] = sum_j w_j acc_j with the two's complement plane weights (the top plane -2^j) */
AI void store_planes(const __m512 *acc, const int bits, __mmask16 lanes, float *out) {
    __m512 v = _mm512_setzero_ps();
    for (int j = 0; j < bits; j++) {
        float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
        v = _mm512_fmadd_ps(acc[j], _mm512_set1_ps(w), v);
    }
    _mm512_mask_storeu_ps(out, lanes, v);
}

/* 8 bytes of each of the 16 rows at q + row offset, as two dword vectors (bytes 0-3 and 4-7 of every row): two
 * qword gathers and two permutes, cheaper than two dword gathers (a gather costs about one load per element) */
AI void gather_pair(const uint8_t *q, __m256i vlo, __m256i vhi, __mmask16 lanes, __m512i *g0, __m512i *g1) {
    const __m512i A = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)lanes, vlo, q, 1);
    const __m512i B = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), (__mmask8)(lanes >> 8), vhi, q, 1);
    *g0 = _mm512_permutex2var_epi32(
        A, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), B);
    *g1 = _mm512_permutex2var_epi32(
        A, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), B);
}

/* the 4 bytes (8 nibbles) of one dword per lane of each plane, looked up in the tables at tk, into acc */
AI void lookup_dword(const __m512i *G, const float *tk, __m512 *acc, const int bits) {
    for (int j = 0; j < bits; j++) /* plane by plane: the tables stay memory operands, nothing spills */
        for (int b = 0; b < 4; b++) {
            __m512i g = b ? _mm512_srli_epi32(G[j], 8 * b) : G[j];
            acc[j] = _mm512_add_ps(acc[j], _mm512_add_ps(_mm512_permutexvar_ps(g, _mm512_load_ps(tk + 32 * b)),
                                                         _mm512_permutexvar_ps(_mm512_srli_epi32(g, 4),
                                                                               _mm512_load_ps(tk + 32 * b + 16))));
        }
}

/* out[i] = sum_c v_c z_c for rows r0 + i, i < nr, of a planes stage (v: `bits`-bit two's complement) */
AI void planes_tile_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                      const float *tab, float *out, const int bits) {
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    const __m512i vidx = tile_offsets(rowbytes);
    const __m256i vlo = _mm512_castsi512_si256(vidx), vhi = _mm512_extracti64x4_epi64(vidx, 1);
    const uint8_t *p = base + r0 * rowbytes;
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= rowbytes; k += 8) {
        tile_prefetch(p, rowbytes, plane_stride, bits, k, 8);
        __m512i G0[4], G1[4];
        for (int j = 0; j < bits; j++) gather_pair(p + j * plane_stride + k, vlo, vhi, lanes, &G0[j], &G1[j]);
        lookup_dword(G0, tab + 32 * k, acc, bits);
        lookup_dword(G1, tab + 32 * (k + 4), acc, bits);
    }
    for (; k + 4 <= rowbytes; k += 4) {
        __m512i G[4];
        for (int j = 0; j < bits; j++)
            G[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + j * plane_stride + k, 1);
        lookup_dword(G, tab + 32 * k, acc, bits);
    }
    store_planes(acc, bits, lanes, out);
    planes_tail(p, plane_stride, rowbytes, k, nr, tab, out, bits);
}

/* out[i] = sum_c v_c z_c (see above) for rows r0 + i of a onehot stage; pm: the tile's parity spread to one bit
 * per coordinate (row i at pm + i * rowbytes) */
AI void onehot_tile_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                      const uint8_t *pm, const float *tab, float *out, const int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    const __m512i vidx = tile_offsets(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= rowbytes; k += 4) {
        tile_prefetch(p, rowbytes, plane_stride, K + 1, k, 4);
        __m512i M[6], V[4];
        for (int m = 0; m < K; m++)
            M[m] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + m * plane_stride + k, 1);
        __m512i S = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, p + K * plane_stride + k, 1);
        __m512i P = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, vidx, pm + k, 1);
        ONEHOT_SLICE(__m512i, _mm512_setzero_si512(), M, P, S, V, K, nb);
        lookup_dword(V, tab + 32 * k, acc, bits);
    }
    store_planes(acc, bits, lanes, out);
    onehot_tail(p, plane_stride, rowbytes, k, nr, pm, tab, out, K);
}

/* Step k of a onehot tile copy: its lines read (and the next tile's prefetched, `ahead` bytes on), its spread
 * parity taken from the parity words pw (spread_parity16), and the planes of v bit-sliced into V (planes 0 .. nb). */
AI void onehot_tiled_step(const uint8_t *tile, int64_t k, int64_t ahead, const uint32_t *pw, int64_t pwords,
                          __m512i *V, const int K) {
    const int nb = onehot_value_bits(K);
    const uint8_t *q = tile + k * (K + 1) * 64;
    for (int m = 0; m <= K; m++) prefetch_line(q + m * 64, ahead);
    __m512i M[6];
    for (int m = 0; m < K; m++) M[m] = _mm512_loadu_si512(q + m * 64);
    const __m512i S = _mm512_loadu_si512(q + K * 64);
    const __m512i P = (__m512i)spread_parity16(pw, pwords, k, 0);
    ONEHOT_SLICE(__m512i, _mm512_setzero_si512(), M, P, S, V, K, nb);
}

/* onehot_tile_t on a 16-row tile copy of the stage (tile[k][plane][16 rows][4 bytes], K masks then the sign, zero
 * past a row's end): the same bit slicing and lookups, with plain loads instead of K + 1 gathers a step, and the
 * spread parity from the tile's parity words pw (pwords of them, [word][16 rows]). tab must cover
 * 4 * ceil(rowbytes / 4) bytes (zero past the row). */
AI void onehot_tiled_tile_t(const uint8_t *tile, int64_t steps, int nr, const uint32_t *pw, int64_t pwords,
                            const float *tab, float *out, const int K) {
    const int64_t ahead = steps * (K + 1) * 64; /* the next tile */
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __mmask16 lanes = (__mmask16)((1u << nr) - 1u);
    __m512 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm512_setzero_ps();
    const int64_t nch = (steps + 7) / 8, part = (nch + TILE_STREAMS - 1) / TILE_STREAMS; /* chunks of 8 steps */
    for (int64_t ci = 0; ci < part * TILE_STREAMS; ci++) { /* the parts of the tile in turn ("Streaming") */
        const int64_t c = (ci % TILE_STREAMS) * part + ci / TILE_STREAMS, k1 = c * 8 + 8 < steps ? c * 8 + 8 : steps;
        if (c >= nch) continue;
        for (int64_t k = c * 8; k < k1; k++) {
            __m512i V[4];
            onehot_tiled_step(tile, k, ahead, pw, pwords, V, K);
            lookup_dword(V, tab + 128 * k, acc, bits);
        }
    }
    store_planes(acc, bits, lanes, out);
}

static void onehot_tiled_tile(const uint8_t *tile, int64_t steps, int nr, const uint32_t *pw, int64_t pwords,
                              const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tiled_tile_t, tile, steps, nr, pw, pwords, tab, out);
}

static void planes_tile(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr, const float *tab,
                        float *out, int bits) {
    switch (bits) {
    case 4: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 4); break;
    case 3: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 3); break;
    case 2: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 2); break;
    default: planes_tile_t(base, stride, rowbytes, r0, nr, tab, out, 1); break;
    }
}

static void onehot_tile(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr, const uint8_t *pm,
                        const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tile_t, base, stride, rowbytes, r0, nr, pm, tab, out);
}
#endif

#if HAVE_AVX2
/* The AVX2 Leech kernels: the AVX-512 tile scheme on 8 rows (a 16-row tile in two halves). vpermps reads 3 bits of
 * a lane, so a nibble's 16-entry lookup is two permutes (entries 0-7, 8-15) and a blend on bit 3. */
AI __m256 lookup16(__m256i g, const float *t) {
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(t), g);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(t + 8), g);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(g, 28)));
}

/* parity_tiled (AVX-512, above) on two halves of 8 rows, with lookup16: 6 operations per 4 blocks of 8 rows, where
 * parity_term takes about 6 per 8 blocks of one row */
static void parity_tiled(const uint32_t *pt, int64_t words, const float *ptab, float *out) {
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < words; k++) {
        const float *tb = ptab + 128 * k;
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(pt + 16 * k + 8 * h));
            for (int n = 0; n < 8; n++) a[h] = _mm256_add_ps(a[h], lookup16(_mm256_srli_epi32(v, 4 * n), tb + 16 * n));
        }
    }
    _mm256_storeu_ps(out, a[0]);
    _mm256_storeu_ps(out + 8, a[1]);
}

/* the 4 bytes (8 nibbles) of one dword per lane of each plane, looked up in the tables at tk, into acc */
AI void lookup_dword8(const __m256i *G, const float *tk, __m256 *acc, const int bits) {
    for (int j = 0; j < bits; j++)
        for (int b = 0; b < 4; b++) {
            const __m256i g = b ? _mm256_srli_epi32(G[j], 8 * b) : G[j];
            acc[j] = _mm256_add_ps(acc[j], _mm256_add_ps(lookup16(g, tk + 32 * b),
                                                         lookup16(_mm256_srli_epi32(g, 4), tk + 32 * b + 16)));
        }
}

/* out[i] = sum_j w_j acc_j[i] for i < nr, the two's complement plane weights (the top plane -2^j) */
AI void store_planes8(const __m256 *acc, const int bits, int nr, float *out) {
    __m256 v = _mm256_setzero_ps();
    for (int j = 0; j < bits; j++) {
        const float w = j == bits - 1 ? -(float)(1 << j) : (float)(1 << j);
        v = _mm256_fmadd_ps(acc[j], _mm256_set1_ps(w), v);
    }
    _mm256_maskstore_ps(out, lanes8(nr), v);
}

/* lane i: i * rowbytes, the offset of row i of an 8-row tile */
AI __m256i row_offsets8(int64_t rowbytes) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)rowbytes));
}

/* dword k of each of the nr <= 8 rows at p (row i at p + i * rowbytes) */
AI __m256i gather_rows8(const uint8_t *p, __m256i vidx, __m256i lanes) {
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)p, vidx, lanes, 1);
}

/* 8 bytes of each of the nr <= 8 rows at p, as two dword vectors (bytes 0-3 and 4-7 of every row): two qword
 * gathers (4 rows each) and four permutes, cheaper than two dword gathers (a gather costs about a load an element;
 * 834 -> 787 us for leech planes at 4096 x 4096 on a Zen 5 running the AVX2 build) */
AI void gather_pair8(const uint8_t *p, __m128i vlo, __m128i vhi, __m256i klo, __m256i khi, __m256i *g0, __m256i *g1) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i A = _mm256_permutevar8x32_epi32(
        _mm256_mask_i32gather_epi64(_mm256_setzero_si256(), (const long long *)p, vlo, klo, 1), order);
    const __m256i B = _mm256_permutevar8x32_epi32(
        _mm256_mask_i32gather_epi64(_mm256_setzero_si256(), (const long long *)p, vhi, khi, 1), order);
    *g0 = _mm256_permute2x128_si256(A, B, 0x20);
    *g1 = _mm256_permute2x128_si256(A, B, 0x31);
}

/* the next 8 rows' bytes [8 k, 8 (k + 4)) of each plane (one contiguous run a plane), a line every other step */
AI void tile8_prefetch(const uint8_t *p, int64_t rowbytes, int64_t plane_stride, int planes, int64_t k) {
    if ((8 * k) & 63) return;
    for (int j = 0; j < planes; j++) _mm_prefetch((const char *)(p + 8 * rowbytes + j * plane_stride + 8 * k), _MM_HINT_T0);
}

/* planes_tile_t on rows r0 .. r0 + nr - 1, nr <= 8 */
AI void planes_tile8_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                       const float *tab, float *out, const int bits) {
    const __m256i lanes = lanes8(nr);
    const __m256i vidx = row_offsets8(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m256 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm256_setzero_ps();
    const __m128i vlo = _mm256_castsi256_si128(vidx), vhi = _mm256_extracti128_si256(vidx, 1);
    const __m256i klo = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr), _mm256_setr_epi64x(0, 1, 2, 3));
    const __m256i khi = _mm256_cmpgt_epi64(_mm256_set1_epi64x(nr), _mm256_setr_epi64x(4, 5, 6, 7));
    int64_t k = 0;
    for (; k + 8 <= rowbytes; k += 8) {
        tile8_prefetch(p, rowbytes, plane_stride, bits, k);
        tile8_prefetch(p, rowbytes, plane_stride, bits, k + 4);
        __m256i G0[4], G1[4];
        for (int j = 0; j < bits; j++) gather_pair8(p + j * plane_stride + k, vlo, vhi, klo, khi, &G0[j], &G1[j]);
        lookup_dword8(G0, tab + 32 * k, acc, bits);
        lookup_dword8(G1, tab + 32 * (k + 4), acc, bits);
    }
    for (; k + 4 <= rowbytes; k += 4) {
        __m256i G[4];
        for (int j = 0; j < bits; j++) G[j] = gather_rows8(p + j * plane_stride + k, vidx, lanes);
        lookup_dword8(G, tab + 32 * k, acc, bits);
    }
    store_planes8(acc, bits, nr, out);
    planes_tail(p, plane_stride, rowbytes, k, nr, tab, out, bits);
}

/* onehot_tile_t on rows r0 .. r0 + nr - 1, nr <= 8 (pm: their spread parity, row i at pm + i * rowbytes) */
AI void onehot_tile8_t(const uint8_t *base, int64_t plane_stride, int64_t rowbytes, int64_t r0, int nr,
                       const uint8_t *pm, const float *tab, float *out, const int K) {
    const int nb = onehot_value_bits(K), bits = nb + 1;
    const __m256i lanes = lanes8(nr);
    const __m256i vidx = row_offsets8(rowbytes);
    const uint8_t *p = base + r0 * rowbytes;
    __m256 acc[4];
    for (int j = 0; j < bits; j++) acc[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= rowbytes; k += 4) {
        tile8_prefetch(p, rowbytes, plane_stride, K + 1, k);
        __m256i M[6], V[4];
        for (int m = 0; m < K; m++) M[m] = gather_rows8(p + m * plane_stride + k, vidx, lanes);
        const __m256i S = gather_rows8(p + K * plane_stride + k, vidx, lanes);
        const __m256i P = gather_rows8(pm + k, vidx, lanes);
        ONEHOT_SLICE(__m256i, _mm256_setzero_si256(), M, P, S, V, K, nb);
        lookup_dword8(V, tab + 32 * k, acc, bits);
    }
    store_planes8(acc, bits, nr, out);
    onehot_tail(p, plane_stride, rowbytes, k, nr, pm, tab, out, K);
}

static void planes_tile8(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr,
                         const float *tab, float *out, int bits) {
    switch (bits) {
    case 4: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 4); break;
    case 3: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 3); break;
    case 2: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 2); break;
    default: planes_tile8_t(base, stride, rowbytes, r0, nr, tab, out, 1); break;
    }
}

static void onehot_tile8(const uint8_t *base, int64_t stride, int64_t rowbytes, int64_t r0, int nr,
                         const uint8_t *pm, const float *tab, float *out, int K) {
    ONEHOT_DISPATCH(K, onehot_tile8_t, base, stride, rowbytes, r0, nr, pm, tab, out);
}
#endif

/* the row's parity bits spread to one bit per coordinate (3 bytes a block), 8 blocks per table entry */
static uint8_t g_spread[256][24];

__attribute__((constructor)) static void init_spread(void) {
    for (int v = 0; v < 256; v++)
        for (int t = 0; t < 24; t++) g_spread[v][t] = ((v >> (t / 3)) & 1) ? 0xff : 0x00;
}

static void spread_parity(const uint8_t *par, int64_t parbytes, int64_t first, int64_t nblk, uint8_t *pmask) {
    int64_t b = 0;
    for (; b + 8 <= nblk; b += 8) memcpy(pmask + 3 * b, g_spread[get_bits(par, parbytes, (uint64_t)(first + b), 8)], 24);
    for (; b < nblk; b++) {
        uint8_t fill = parity_bit(par, first + b) ? 0xff : 0x00;
        pmask[3 * b] = pmask[3 * b + 1] = pmask[3 * b + 2] = fill;
    }
}

static int leech_init(Leech *L, int nstages, const uint8_t *const *streams, const int64_t *stream_bytes,
                      const int *layout, const int *param, const float *alpha, const uint16_t *scale, int64_t rows,
                      int64_t cols) {
    if (nstages < 1 || nstages > 2 || rows < 0 || cols < 24 || cols % 24) return -1;
    L->nstages = nstages;
    L->scale = scale;
    L->rows = rows;
    L->cols = cols;
    L->nblk = cols / 24;
    L->tiled[0] = L->tiled[1] = NULL;
    int64_t n = rows * L->nblk;
    for (int s = 0; s < nstages; s++) {
        L->stream[s] = streams[s];
        L->stream_bytes[s] = stream_bytes[s];
        L->layout[s] = layout[s];
        L->param[s] = param[s];
        L->alpha[s] = alpha[s];
        int planes = layout[s] == LEECH_PLANES ? param[s] : param[s] + 1;
        if ((layout[s] != LEECH_PLANES && layout[s] != LEECH_ONEHOT) || param[s] < 1 ||
            (layout[s] == LEECH_PLANES && param[s] > 4) || (layout[s] == LEECH_ONEHOT && param[s] > 6))
            return -1;
        if (stream_bytes[s] != planes * 3 * n + (n + 7) / 8) return -2;
    }
    return 0;
}
