/* the Leech matvec and decode: stage dispatch over rows and threads, and their API.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */


/* the Leech kernels read tile copies of 4-plane and onehot stages (AVX-512 VNNI + GFNI, or AVX2) */
API int accel_leech_tiles_available(void) { return (HAVE_LEECH_TILES || HAVE_LEECH_LUT) && g_simd; }
/* how this build's 4-plane tile copy orders a half-step: 0 a qword a row (AVX-512), 1 A then B with the top plane
 * complemented (AVX2, leech_lut_step) */
API int accel_leech_planes_lane_order(void) { return HAVE_LEECH_LUT; }

/* t[r] = scale[r] * sum_s alpha_s <x_s[r], z> for rows [0, rows), in tiles of 16 rows */
static void leech_rows(const Leech *L, const float *z, const float *zb, float *t, int nthreads) {
    const int64_t n = L->rows * L->nblk, plane = 3 * n, rowbytes = 3 * L->nblk, parbytes = (n + 7) / 8;
    const int64_t tiles = (L->rows + 15) / 16;
    float *tab = NULL;
    int need_tab = 1; /* the lookup tables: for every stage that the integer tile kernel does not take */
    const int64_t tsteps = (rowbytes + 1) / 2; /* of a 4-plane tile copy */
#if HAVE_LEECH_TILES
    int64_t *xq = NULL;
    float *tunit = NULL;
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        xq = xalloc((size_t)tsteps * 6 * sizeof(int64_t));
        tunit = xalloc((size_t)((tsteps + 7) / 8) * 2 * sizeof(float));
        if (!leech_tiled_input(z, L->cols, tsteps, xq, tunit, tunit + (tsteps + 7) / 8)) { /* the float path */
            free(xq);
            xq = NULL;
        }
    }
    int32_t *xo = NULL; /* onehot tiles' input digits */
    if (xq) {
        need_tab = 0;
        for (int s = 0; s < L->nstages; s++)
            need_tab |= !L->tiled[s] || (L->layout[s] == LEECH_ONEHOT && !HAVE_ONEHOT_INT);
#if HAVE_ONEHOT_INT
        for (int s = 0; s < L->nstages; s++)
            if (L->tiled[s] && L->layout[s] == LEECH_ONEHOT && !xo) {
                xo = xalloc((size_t)((rowbytes + 3) / 4) * 24 * sizeof(int32_t));
                onehot_int_input(xq, tsteps, (rowbytes + 3) / 4, xo);
            }
#endif
    }
#endif
#if HAVE_LEECH_LUT
    int8_t *ltab = NULL; /* the AVX2 tiles' byte tables, then per block unit and zsum */
    float *lunit = NULL;
    const int64_t lsteps = 2 * ((rowbytes + 3) / 4), lblocks = (lsteps + 7) / 8; /* >= tsteps; onehot steps */
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        ltab = xalloc((size_t)lsteps * LUT_PIECES * 64);
        lunit = xalloc((size_t)lblocks * 2 * sizeof(float));
        if (leech_lut_input(z, L->cols, lsteps, ltab, lunit, lunit + lblocks)) {
            need_tab = 0;
            for (int s = 0; s < L->nstages; s++) need_tab |= !L->tiled[s];
        } else { /* a non-finite input: the float path */
            free(ltab);
            ltab = NULL;
        }
    }
#endif
    float *ptab = NULL; /* parity tables for the tile copies' parity words */
    const int64_t pwords = (L->nblk + 31) / 32;
#if HAVE_AVX512 || HAVE_AVX2
    if (g_simd && (L->tiled[0] || (L->nstages > 1 && L->tiled[1]))) {
        float *zbp = xalloc((size_t)pwords * 32 * sizeof(float));
        memset(zbp, 0, (size_t)pwords * 32 * sizeof(float));
        memcpy(zbp, zb, (size_t)L->nblk * sizeof(float));
        ptab = xalloc((size_t)pwords * 128 * sizeof(float));
        build_tables(zbp, pwords * 32, ptab);
        free(zbp);
    }
#endif
    if (need_tab) { /* padded to whole dwords of a row (zero): the onehot tile copies read them */
        tab = xalloc((size_t)(L->cols + 32) * 4 * sizeof(float));
        memset(tab, 0, (size_t)(L->cols + 32) * 4 * sizeof(float));
        build_tables(z, L->cols, tab);
    }
    int tile_kernels = HAVE_AVX512; /* the tile copies are read (else the stored streams): AVX2 needs the tables */
#if HAVE_LEECH_LUT
    tile_kernels = ltab != NULL;
#endif
    int nt = threads_for(nthreads, (double)L->rows * L->cols);
#pragma omp parallel num_threads(nt)
    {
        uint8_t *pm = xalloc((size_t)(16 * rowbytes + 64));
        memset(pm, 0, (size_t)(16 * rowbytes + 64));
        float vals[16];
#pragma omp for schedule(guided, 2) /* runs of tiles: the prefetched next tile is mostly this thread's */
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t r0 = tile * 16;
            const int nr = L->rows - r0 < 16 ? (int)(L->rows - r0) : 16;
            float total[16] = {0};
            for (int s = 0; s < L->nstages; s++) {
                const uint8_t *base = L->stream[s];
                const int onehot = L->layout[s] == LEECH_ONEHOT;
                const uint8_t *par = base + (onehot ? L->param[s] + 1 : L->param[s]) * plane;
                const int64_t tbytes = onehot ? ((rowbytes + 3) / 4) * (L->param[s] + 1) * 64 : tsteps * 128;
                /* the tile's parity words, after the tiles (unread by the scalar build) */
                __attribute__((unused)) const uint32_t *pw =
                    L->tiled[s] ? (const uint32_t *)(L->tiled[s] + tiles * tbytes) + tile * pwords * 16 : NULL;
                if (onehot && !(g_simd && L->tiled[s] && tile_kernels))
                    for (int i = 0; i < nr; i++)
                        spread_parity(par, parbytes, (r0 + i) * L->nblk, L->nblk, pm + i * rowbytes);
#if HAVE_AVX512
                if (g_simd) {
#if HAVE_LEECH_TILES
                    if (xq && L->tiled[s] && !onehot)
                        leech_tiled_tile(L->tiled[s], tsteps, tile, xq, tunit, tunit + (tsteps + 7) / 8, vals);
                    else
#endif
#if HAVE_ONEHOT_INT
                    if (xo && onehot && L->tiled[s])
                        onehot_int_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, pw, pwords, xo, tunit,
                                        tunit + (tsteps + 7) / 8, vals, L->param[s]);
                    else
#endif
                    if (onehot && L->tiled[s])
                        onehot_tiled_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, nr, pw, pwords, tab, vals,
                                          L->param[s]);
                    else if (onehot) onehot_tile(base, plane, rowbytes, r0, nr, pm, tab, vals, L->param[s]);
                    else planes_tile(base, plane, rowbytes, r0, nr, tab, vals, L->param[s]);
                } else
#elif HAVE_AVX2
                if (g_simd) {
#if HAVE_LEECH_LUT
                    if (ltab && L->tiled[s] && !onehot)
                        leech_lut_tile(L->tiled[s], tsteps, tile, ltab, lunit, lunit + lblocks, vals);
                    else if (ltab && L->tiled[s])
                        onehot_lut_tile(L->tiled[s] + tile * tbytes, (rowbytes + 3) / 4, pw, pwords, ltab, lunit,
                                        lunit + lblocks, vals, L->param[s]);
                    else
#endif
                    for (int h = 0; h < nr; h += 8) { /* the tile in two halves of 8 rows */
                        const int nh = nr - h < 8 ? nr - h : 8;
                        if (onehot) onehot_tile8(base, plane, rowbytes, r0 + h, nh, pm + h * rowbytes, tab, vals + h,
                                                 L->param[s]);
                        else planes_tile8(base, plane, rowbytes, r0 + h, nh, tab, vals + h, L->param[s]);
                    }
                } else
#endif
                { /* scalar: the same table lookups, a byte of a row at a time (with the parity term's branch removed,
                   * 19.5x / 6.8x faster on planes / onehot at 4096 x 4096 than the bit-by-bit sums they replaced) */
                    const uint8_t *p = base + r0 * rowbytes;
                    for (int i = 0; i < nr; i++) vals[i] = 0.0f;
                    if (onehot) onehot_tail(p, plane, rowbytes, 0, nr, pm, tab, vals, L->param[s]);
                    else planes_tail(p, plane, rowbytes, 0, nr, tab, vals, L->param[s]);
                }
                float pv[16]; /* x = 2 v + p: the parity term from the tile copy's parity words, or from the stream */
#if HAVE_AVX512 || HAVE_AVX2
                if (g_simd && pw) parity_tiled(pw, pwords, ptab, pv);
                else
#endif
                    for (int i = 0; i < nr; i++) pv[i] = parity_term(par, parbytes, (r0 + i) * L->nblk, L->nblk, zb);
                for (int i = 0; i < nr; i++) total[i] += L->alpha[s] * (2.0f * vals[i] + pv[i]);
            }
            for (int i = 0; i < nr; i++) t[r0 + i] = half_to_float(L->scale[r0 + i]) * total[i];
        }
        free(pm);
    }
    free(tab);
    free(ptab);
#if HAVE_LEECH_TILES
    free(xq);
    free(tunit);
    free(xo);
#endif
#if HAVE_LEECH_LUT
    free(ltab);
    free(lunit);
#endif
}

/* y = U^T T V x: V as (sign, R, odd size), U as (sign, R^T, odd size); x has in_features <= cols entries (zero padded) */
API int accel_leech_matvec(int nstages, const uint8_t *const *streams, const int64_t *stream_bytes, const int *layout,
                           const int *param, const float *alpha, const uint16_t *scale, const uint8_t *const *tiled,
                           int64_t rows, int64_t cols,
                           int64_t in_features, const float *sign_in, const float *rot_in, int64_t odd_in,
                           const float *sign_out, const float *rot_out_t, int64_t odd_out, const float *x, float *y,
                           int nthreads) {
    Leech L;
    int err = leech_init(&L, nstages, streams, stream_bytes, layout, param, alpha, scale, rows, cols);
    if (err) return err;
    for (int s = 0; s < nstages && tiled; s++) /* tile copies of 4-plane and onehot stages */
        L.tiled[s] = (layout[s] == LEECH_PLANES && param[s] == 4) || layout[s] == LEECH_ONEHOT ? tiled[s] : NULL;
    if (in_features > cols || in_features < 1 || odd_in < 1 || cols % odd_in || odd_out < 1 || rows % odd_out)
        return -1;
    int64_t big = cols > rows ? cols : rows;
    float *z = xalloc((size_t)(cols + 16) * sizeof(float));
    float *tmp = xalloc((size_t)(big + 16) * sizeof(float));
    float *zb = xalloc((size_t)(L.nblk + 16) * sizeof(float));
    memcpy(z, x, (size_t)in_features * sizeof(float));
    memset(z + in_features, 0, (size_t)(cols - in_features) * sizeof(float));
    g_rht_threads = nthreads > 0 ? nthreads : omp_get_max_threads();
    rht_one(z, cols, sign_in, rot_in, odd_in, 0, tmp);
    for (int64_t b = 0; b < L.nblk; b++) {
        float s = 0.0f;
        for (int i = 0; i < 24; i++) s += z[24 * b + i];
        zb[b] = s;
    }
    leech_rows(&L, z, zb, y, nthreads);
    rht_one(y, rows, sign_out, rot_out_t, odd_out, 1, tmp);
    g_rht_threads = 1;
    free(z);
    free(tmp);
    free(zb);
    return 0;
}

/* o[t] += alpha * x_t for the 8 coordinates of one byte position: x = 2 v + p, v in `bits`-bit two's complement
 * (the top bit weighs -2^(bits-1)) with bit j of v in bit t of V[j] */
static inline __attribute__((always_inline)) void add_coords8(float *o, const unsigned *V, int p, float alpha,
                                                              const int bits) {
    for (int t = 0; t < 8; t++) {
        int v = 0;
        for (int j = 0; j < bits; j++) v += (int)((V[j] >> t) & 1u) << j;
        v -= (int)((V[bits - 1] >> t) & 1u) << bits;
        o[t] += alpha * (float)(2 * v + p);
    }
}

/* rows [r0, r1) of T = scale * sum_s alpha_s x_s (the transformed weight, cols wide) */
API int accel_leech_decode_rows(int nstages, const uint8_t *const *streams, const int64_t *stream_bytes,
                                const int *layout, const int *param, const float *alpha, const uint16_t *scale,
                                int64_t rows, int64_t cols, int64_t r0, int64_t r1, float *out, int nthreads) {
    Leech L;
    int err = leech_init(&L, nstages, streams, stream_bytes, layout, param, alpha, scale, rows, cols);
    if (err) return err;
    if (r0 < 0 || r1 > rows || r0 > r1) return -1;
    const int64_t n = rows * L.nblk, plane = 3 * n, rowbytes = 3 * L.nblk;
    int nt = threads_for(nthreads, (double)(r1 - r0) * cols);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 8)
    for (int64_t r = r0; r < r1; r++) {
        float *o = out + (r - r0) * cols;
        float s = half_to_float(scale[r]);
        for (int64_t c = 0; c < cols; c++) o[c] = 0.0f;
        for (int st = 0; st < nstages; st++) {
            const uint8_t *base = L.stream[st] + r * rowbytes;
            const int onehot = L.layout[st] == LEECH_ONEHOT, K = L.param[st];
            const uint8_t *par = L.stream[st] + (onehot ? K + 1 : K) * plane;
            const int nb = onehot ? (K + 1 >= 4 ? 3 : (K + 1 >= 2 ? 2 : 1)) : 0, bits = onehot ? nb + 1 : K;
            for (int64_t kb = 0; kb < rowbytes; kb++) { /* 8 coordinates, all in block kb / 3 */
                const int p = parity_bit(par, r * L.nblk + kb / 3);
                unsigned V[4];
                if (onehot) {
                    unsigned M[6], S = base[K * plane + kb], P = p ? 0xffu : 0u;
                    for (int m = 0; m < K; m++) M[m] = base[m * plane + kb];
                    ONEHOT_SLICE(unsigned, 0u, M, P, S, V, K, nb);
                } else {
                    for (int j = 0; j < bits; j++) V[j] = base[j * plane + kb];
                }
                switch (bits) { /* constant widths unroll and vectorize */
                case 4: add_coords8(o + 8 * kb, V, p, L.alpha[st], 4); break;
                case 3: add_coords8(o + 8 * kb, V, p, L.alpha[st], 3); break;
                case 2: add_coords8(o + 8 * kb, V, p, L.alpha[st], 2); break;
                default: add_coords8(o + 8 * kb, V, p, L.alpha[st], 1); break; /* leech_init: 1 <= bits <= 4 */
                }
            }
        }
        for (int64_t c = 0; c < cols; c++) o[c] *= s;
    }
    return 0;
}
