/* the large-copy and read probes the benchmarks measure bandwidth with.
 * A part of accel_kernels.c, which #includes it: one translation unit, so the static helpers and
 * inlining reach across the parts; not compiled on its own. */

/* -------------------------------------------------------------------------------------------- bandwidth */

/* dst <- src with every thread copying its own contiguous slice; the copy bandwidth bench/gemv.py compares to */
API void accel_copy(float *dst, const float *src, int64_t n, int nthreads) {
    int nt = threads_for(nthreads, (double)n);
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        int64_t a = n * t / k, b = n * (t + 1) / k;
        memcpy(dst + a, src + a, (size_t)(b - a) * sizeof(float));
    }
}

/* Sum of src, every thread reading its own contiguous slice: the read-only bandwidth bench/gemv.py also compares
 * to, in two patterns because the faster one changes with the host. streams = 2: two streams in turn (4 KB blocks
 * from each half alternately, each line prefetched 1 KB ahead), the fastest in a scratch probe against 1-8 streams
 * a thread, 1 or 4 KB blocks and other prefetch distances and levels on the Zen 5 host (36-38 GB/s, 2026-12-03).
 * streams = 1: one plain stream, no software prefetch, the fastest on the Zen 4 host (28-68 GB/s against 20-30 for
 * streams = 2 in each of the 36 probe pairs of six bench/gemv.py runs, 2026-12-06; docs/kernels.md, "Streaming"). */
API float accel_read(const float *src, int64_t n, int nthreads, int streams) {
    int nt = threads_for(nthreads, (double)n);
    float total = 0.0f;
#pragma omp parallel num_threads(nt) reduction(+ : total)
    {
        int t = omp_get_thread_num(), k = omp_get_num_threads();
        const int64_t a = n * t / k, b = n * (t + 1) / k;
        float acc[16] = {0};
        if (streams == 1) {
            int64_t i = a;
            for (; i + 16 <= b; i += 16)
                for (int l = 0; l < 16; l++) acc[l] += src[i + l];
            for (; i < b; i++) acc[0] += src[i];
        } else {
            const int64_t mid = a + (b - a) / 2, block = 1024; /* floats: 4 KB */
            const int64_t start[2] = {a, mid}, end[2] = {mid, b};
            for (int64_t off = 0; off < b - mid; off += block) {
                for (int s = 0; s < 2; s++) {
                    const int64_t i0 = start[s] + off, i1 = i0 + block < end[s] ? i0 + block : end[s];
                    int64_t i = i0;
                    for (; i + 16 <= i1; i += 16) {
                        __builtin_prefetch(src + i + 256, 0, 3);
                        for (int l = 0; l < 16; l++) acc[l] += src[i + l];
                    }
                    for (; i < i1; i++) acc[0] += src[i];
                }
            }
        }
        for (int l = 0; l < 16; l++) total += acc[l];
    }
    return total;
}
