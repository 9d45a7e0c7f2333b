/* kvgen's CPU copy kernel: one call moves one chunk (or one layer of it) between a paged
 * cache and a memory object, as nested loops over up to KV_MAXD dims around a contiguous
 * run of bytes copied with memcpy.
 *
 * Each dim is described by 11 int64 fields (see kvgen/runtime/native.py, which builds them
 * from a connector's layout):
 *   ext    entries of the dim
 *   idx    0, or the address of ext int64 values v (else v = first + i)
 *   first  value of entry 0 when idx is 0
 *   div    > 1: v is a slot, split into (v / div, v % div) = (block, position in block)
 *   cs     cache bytes per unit of v (per block when div > 1)
 *   cs2    cache bytes per position in a block (div > 1 only)
 *   tok    0, or the address of ext int64 object positions (else position i)
 *   os     object bytes per position
 *   ls     cache leaves per unit of v (a list level of the cache: a different tensor)
 *   div2   > 1 (div > 1 only): the position in a block is split again into (tile, place) =
 *          (pos / div2, pos % div2), a cache whose block slots are two dims (N/8 and N%8)
 *   cs3    cache bytes per place (div2 > 1 only; cs2 is then the bytes per tile)
 * An entry whose v is < 0 is skipped (a token with no slot). Nothing here checks bounds:
 * the connector checked every slot, block and position before calling.
 *
 * Built by the system C compiler on first use into a per-user cache (no torch headers);
 * loaded with ctypes. Without a compiler, connectors use their torch path.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define KV_MAXD 8
#define KV_FIELDS 11
#define KV_MAXT 16

typedef struct {
    int64_t ext, first, div, cs, cs2, os, ls, div2, cs3;
    const int64_t *idx, *tok;
    int shift, shift2; /* log2 of div and div2 where they are powers of two, else -1 */
} kv_dim;

/* log2 of d where d > 1 is a power of two, else -1: block sizes almost always are, and a
 * shift and a mask cost a cycle where a 64-bit division costs tens, once per slot per layer. */
static int kv_log2(int64_t d) {
    if (d <= 1 || (d & (d - 1)) != 0)
        return -1;
    int k = 0;
    while (((int64_t)1 << k) < d)
        k++;
    return k;
}

static void kv_dim_shifts(kv_dim *d) {
    d->shift = kv_log2(d->div);
    d->shift2 = kv_log2(d->div2);
}

/* Cache bytes of entry value v along dim d: a slot split into block and position (and the
 * position into tile and place), or v steps of cs. v >= 0 (the walks skip negative slots),
 * so a shift and a mask split it as a division would. */
static inline int64_t kv_cache_bytes(const kv_dim *d, int64_t v) {
    if (d->div <= 1)
        return v * d->cs;
    int64_t blk, pos;
    if (d->shift >= 0)
        blk = v >> d->shift, pos = v & (d->div - 1);
    else
        blk = v / d->div, pos = v % d->div;
    if (d->div2 > 1) {
        if (d->shift2 >= 0)
            return blk * d->cs + (pos >> d->shift2) * d->cs2 + (pos & (d->div2 - 1)) * d->cs3;
        return blk * d->cs + (pos / d->div2) * d->cs2 + (pos % d->div2) * d->cs3;
    }
    return blk * d->cs + pos * d->cs2;
}

typedef struct {
    int nd;
    kv_dim d[KV_MAXD];
    int64_t run;
    int store;
    char *const *leaves;
    char *obj;
    int64_t shift; /* cache bytes before the first moved element of every leaf */
    int64_t lo, hi; /* the share of dim 0 one thread moves */
    int stream;     /* write with streaming stores (a chunk larger than the caches) */
} kv_job;

#if defined(__SSE2__)
/* `body` bytes, a multiple of 64, to a 16-byte aligned `dst` with streaming stores. Inline: an
 * NVFP4 head's 64 data bytes are one call of this, a million of them per chunk. */
static inline void kv_stream_lines(char *dst, const char *src, int64_t body) {
    for (int64_t b = 0; b < body; b += 64) {
        __m128i w0 = _mm_loadu_si128((const __m128i *)(src + b));
        __m128i w1 = _mm_loadu_si128((const __m128i *)(src + b + 16));
        __m128i w2 = _mm_loadu_si128((const __m128i *)(src + b + 32));
        __m128i w3 = _mm_loadu_si128((const __m128i *)(src + b + 48));
        _mm_stream_si128((__m128i *)(dst + b), w0);
        _mm_stream_si128((__m128i *)(dst + b + 16), w1);
        _mm_stream_si128((__m128i *)(dst + b + 32), w2);
        _mm_stream_si128((__m128i *)(dst + b + 48), w3);
    }
}

/* `run` bytes with 16-byte streaming stores: the unaligned head and the tail by memcpy. */
static void kv_stream(char *dst, const char *src, int64_t run) {
    int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head > run)
        head = run;
    memcpy(dst, src, (size_t)head);
    dst += head;
    src += head;
    run -= head;
    int64_t body = run & ~(int64_t)63;
    kv_stream_lines(dst, src, body);
    memcpy(dst + body, src + body, (size_t)(run - body));
}
#endif

/* Streaming stores are weakly ordered: make them visible before the call returns. */
static inline void kv_fence_stream(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static inline void kv_fence(const kv_job *job) {
#if defined(__SSE2__)
    if (job->stream)
        _mm_sfence();
#else
    (void)job;
#endif
}

/* One run: streamed when the caller asks (a chunk of 8 MiB or more, where a plain store
 * would first read each destination line from memory) and the run is long or whole aligned
 * cache lines (an NVFP4 head's 64 data bytes: a partial line streamed would cost more than it
 * saves), short runs of whole 16-byte words inline (no call), others by memcpy. */
static inline void kv_copy(char *dst, const char *src, int64_t run, int stream) {
#if defined(__SSE2__)
    if (stream && (run & 63) == 0 && ((uintptr_t)dst & 63) == 0) { /* whole lines: no head, no tail */
        kv_stream_lines(dst, src, run);
        return;
    }
    if (stream && run >= 256) {
        kv_stream(dst, src, run);
        return;
    }
#else
    (void)stream;
#endif
    if (run <= 512 && (run & 15) == 0) {
        for (int64_t b = 0; b < run; b += 16)
            memcpy(dst + b, src + b, 16);
        return;
    }
    switch (run) { /* a scalar's width (a plane of scales): one load and one store, not a call */
    case 1: memcpy(dst, src, 1); return;
    case 2: memcpy(dst, src, 2); return;
    case 4: memcpy(dst, src, 4); return;
    case 8: memcpy(dst, src, 8); return;
    default: memcpy(dst, src, (size_t)run);
    }
}

/* n runs at fixed strides. Runs of a scalar's width (the scales and packed words of quantized
 * caches: 8-byte fp4 scale groups, 4-byte fp32 scales) are one load and one store each, not a
 * call to memcpy: such a cache moves millions of them per chunk. */
#define KV_ROWS(width)                                              \
    for (int64_t i = 0; i < n; i++, dst += ds, src += ss)           \
        memcpy(dst, src, width);                                    \
    return
static void kv_rows(char *dst, int64_t ds, const char *src, int64_t ss, int64_t n, int64_t run, int stream) {
    switch (run) {
    case 1: KV_ROWS(1);
    case 2: KV_ROWS(2);
    case 4: KV_ROWS(4);
    case 8: KV_ROWS(8);
    case 16: KV_ROWS(16);
    default:
        for (int64_t i = 0; i < n; i++, dst += ds, src += ss)
            kv_copy(dst, src, run, stream);
    }
}
#undef KV_ROWS

static void kv_walk(const kv_job *job, int k, int64_t leaf, int64_t coff, int64_t ooff) {
    const kv_dim *d = &job->d[k];
    int64_t lo = k == 0 ? job->lo : 0, hi = k == 0 ? job->hi : d->ext;
    int last = k == job->nd - 1;
    if (last && !d->idx && !d->tok && d->div <= 1 && !d->ls) { /* a plain innermost dim: step both pointers */
        char *cp = job->leaves[leaf] + coff + (d->first + lo) * d->cs;
        char *op = job->obj + ooff + lo * d->os;
        if (job->store)
            kv_rows(op, d->os, cp, d->cs, hi - lo, job->run, job->stream);
        else
            kv_rows(cp, d->cs, op, d->os, hi - lo, job->run, job->stream);
        return;
    }
    for (int64_t i = lo; i < hi; i++) {
        int64_t v = d->idx ? d->idx[i] : d->first + i;
        if (v < 0)
            continue;
        int64_t c = kv_cache_bytes(d, v);
        int64_t p = d->tok ? d->tok[i] : i;
        if (last) {
            char *cp = job->leaves[leaf + v * d->ls] + coff + c;
            char *op = job->obj + ooff + p * d->os;
            if (job->store)
                kv_copy(op, cp, job->run, job->stream);
            else
                kv_copy(cp, op, job->run, job->stream);
        } else {
            kv_walk(job, k + 1, leaf + v * d->ls, coff + c, ooff + p * d->os);
        }
    }
}

static void *kv_thread(void *arg) {
    const kv_job *job = (const kv_job *)arg;
    kv_walk(job, 0, 0, job->shift, 0);
    kv_fence(job);
    return NULL;
}

/* The OpenMP runtime the host process already runs (torch's), when the caller registered
 * it: shares then run on that runtime's worker threads. Those threads spin a while after
 * each of torch's parallel regions; threads of our own would compete with them for the
 * cores, where the spinning workers pick a share up at once. */
typedef void (*kv_omp_parallel)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*kv_omp_int)(void);
static kv_omp_parallel kv_parallel;
static kv_omp_int kv_thread_num, kv_num_threads;

typedef struct {
    void *(*body)(void *); /* one thread's share: kv_thread or kv_pair_thread */
    char *jobs;
    size_t size; /* bytes per job */
    int count;
} kv_team;

static void kv_team_body(void *arg) {
    const kv_team *team = (const kv_team *)arg;
    /* a team smaller than asked for still moves every share */
    for (int t = kv_thread_num(); t < team->count; t += kv_num_threads())
        team->body(team->jobs + (size_t)t * team->size);
}

/* Register GOMP_parallel, omp_get_thread_num and omp_get_num_threads of the process's
 * OpenMP runtime (all three, or NULLs to go back to threads of our own). */
void kvgen_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    int all = parallel && thread_num && num_threads;
    kv_parallel = all ? (kv_omp_parallel)parallel : NULL;
    kv_thread_num = all ? (kv_omp_int)thread_num : NULL;
    kv_num_threads = all ? (kv_omp_int)num_threads : NULL;
}

/* Move one chunk. dims: nd * KV_FIELDS int64 values, outermost dim first; run: bytes of
 * the innermost contiguous run; leaves: base address of every cache tensor; obj: the
 * object's base address; shift: bytes added to every leaf address (one layer of a cache
 * whose layers are a dim); threads: how many threads share dim 0 (1: this one only);
 * stream: 1 to write runs of 256 bytes or more with streaming stores where the CPU has them.
 * Returns 0, or -1 for a description it cannot run (the caller then uses torch). */
int kvgen_move(int store, int nd, const int64_t *dims, int64_t run, char *const *leaves, int64_t shift, char *obj,
               int threads, int stream) {

    if (nd < 0 || nd > KV_MAXD || run <= 0)
        return -1;
    kv_job job;
    memset(&job, 0, sizeof job);
    job.nd = nd;
    job.run = run;
    job.store = store;
    job.leaves = leaves;
    job.obj = obj;
    job.shift = shift;
    for (int k = 0; k < nd; k++) {
        const int64_t *f = dims + (int64_t)k * KV_FIELDS;
        kv_dim *d = &job.d[k];
        d->ext = f[0];
        d->idx = (const int64_t *)(intptr_t)f[1];
        d->first = f[2];
        d->div = f[3];
        d->cs = f[4];
        d->cs2 = f[5];
        d->tok = (const int64_t *)(intptr_t)f[6];
        d->os = f[7];
        d->ls = f[8];
        d->div2 = f[9];
        d->cs3 = f[10];
        kv_dim_shifts(d);
        if (d->ext <= 0)
            return 0; /* nothing to move */
    }
    job.stream = stream != 0;
    if (nd == 0) {
        if (store)
            kv_copy(obj, leaves[0] + shift, run, job.stream);
        else
            kv_copy(leaves[0] + shift, obj, run, job.stream);
        kv_fence(&job);
        return 0;
    }
    int64_t ext = job.d[0].ext;
    if (threads > KV_MAXT)
        threads = KV_MAXT;
    if (threads > ext)
        threads = (int)ext;
    if (threads <= 1) {
        job.lo = 0;
        job.hi = ext;
        kv_walk(&job, 0, 0, shift, 0);
        kv_fence(&job);
        return 0;
    }
    kv_job jobs[KV_MAXT];
    pthread_t ids[KV_MAXT];
    int started[KV_MAXT];
    for (int t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].lo = ext * t / threads;
        jobs[t].hi = ext * (t + 1) / threads;
        started[t] = 0;
    }
    if (kv_parallel) {
        kv_team team = {kv_thread, (char *)jobs, sizeof jobs[0], threads};
        kv_parallel(kv_team_body, &team, (unsigned)threads, 0);
        return 0;
    }
    /* this thread takes share 0; a thread that cannot start has its share moved here too */
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, kv_thread, &jobs[t]) == 0;
    kv_walk(&jobs[0], 0, 0, shift, 0);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            kv_walk(&jobs[t], 0, 0, shift, 0);
    }
    kv_fence(&job);
    return 0;
}

/* -- rows between two sets of addresses -------------------------------------------------
 *
 * n rows, each 3 int64: destination address, source address, bytes (a model's state rows,
 * one per layer and state tensor, between the cache and their sections of the object).
 * threads share the rows in order. Nothing here checks bounds: the caller checked each row
 * against its tensor and its section. */
typedef struct {
    const int64_t *rows;
    int64_t lo, hi;
    int stream;
} kv_rjob;

static void *kv_rthread(void *arg) {
    const kv_rjob *job = (const kv_rjob *)arg;
    for (int64_t i = job->lo; i < job->hi; i++) {
        const int64_t *r = job->rows + 3 * i;
        kv_copy((char *)(intptr_t)r[0], (const char *)(intptr_t)r[1], r[2], job->stream);
    }
    if (job->stream)
        kv_fence_stream();
    return NULL;
}

int kvgen_copy_rows(int64_t n, const int64_t *rows, int threads, int stream) {
    if (n <= 0)
        return 0;
    for (int64_t i = 0; i < n; i++)
        if (rows[3 * i + 2] <= 0)
            return -1;
    if (threads > KV_MAXT)
        threads = KV_MAXT;
    if (threads > n)
        threads = (int)n;
    if (threads < 1)
        threads = 1;
    kv_rjob jobs[KV_MAXT];
    pthread_t ids[KV_MAXT];
    int started[KV_MAXT];
    for (int t = 0; t < threads; t++) {
        jobs[t].rows = rows, jobs[t].stream = stream != 0;
        jobs[t].lo = n * t / threads, jobs[t].hi = n * (t + 1) / threads;
        started[t] = 0;
    }
    if (threads == 1) {
        kv_rthread(&jobs[0]);
        return 0;
    }
    if (kv_parallel) {
        kv_team team = {kv_rthread, (char *)jobs, sizeof jobs[0], threads};
        kv_parallel(kv_team_body, &team, (unsigned)threads, 0);
        return 0;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, kv_rthread, &jobs[t]) == 0;
    kv_rthread(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            kv_rthread(&jobs[t]);
    }
    return 0;
}

/* -- the planes of one cache in one walk -------------------------------------------------
 *
 * A cache of several planes (quantized data and its scales, say) whose planes interleave in
 * memory is moved by one walk over the dims they share, each plane's run copied at each
 * entry of the innermost dim; one walk per plane would read every cache line once per plane.
 * Each plane has its own dims (KV_FIELDS each, as kvgen_move's); the caller checked that the
 * planes' dims agree in everything but strides and leaf steps (ext, idx, first, div, tok, div2). */
#define KV_MAXP 4

typedef struct {
    int nd, planes, store, stream;
    kv_dim d[KV_MAXP][KV_MAXD];
    int64_t run[KV_MAXP];
    char *const *leaves[KV_MAXP];
    char *obj;
    int64_t lo, hi;
} kv_mjob;

typedef struct {
    int64_t leaf, coff, ooff;
} kv_at;

static inline void kv_mcopy(const kv_mjob *job, int q, const kv_at *at) {
    char *cp = job->leaves[q][at->leaf] + at->coff, *op = job->obj + at->ooff;
    if (job->store)
        kv_copy(op, cp, job->run[q], job->stream);
    else
        kv_copy(cp, op, job->run[q], job->stream);
}

static void kv_mwalk(const kv_mjob *job, int k, const kv_at *at) {
    const kv_dim *d = &job->d[0][k];
    int64_t lo = k == 0 ? job->lo : 0, hi = k == 0 ? job->hi : d->ext;
    int last = k == job->nd - 1, plain = last && !d->idx && !d->tok && d->div <= 1;
    for (int q = 0; q < job->planes && plain; q++)
        plain = !job->d[q][k].ls;
    if (plain) { /* each plane's row of the innermost dim, plane after plane */
        for (int q = 0; q < job->planes; q++) {
            const kv_dim *e = &job->d[q][k];
            char *cp = job->leaves[q][at[q].leaf] + at[q].coff + (e->first + lo) * e->cs;
            char *op = job->obj + at[q].ooff + lo * e->os;
            if (job->store)
                kv_rows(op, e->os, cp, e->cs, hi - lo, job->run[q], job->stream);
            else
                kv_rows(cp, e->cs, op, e->os, hi - lo, job->run[q], job->stream);
        }
        return;
    }
    kv_at next[KV_MAXP];
    for (int64_t i = lo; i < hi; i++) {
        int64_t v = d->idx ? d->idx[i] : d->first + i;
        if (v < 0)
            continue;
        int64_t p = d->tok ? d->tok[i] : i;
        for (int q = 0; q < job->planes; q++) {
            const kv_dim *e = &job->d[q][k];
            int64_t c = kv_cache_bytes(e, v);
            next[q].leaf = at[q].leaf + v * e->ls;
            next[q].coff = at[q].coff + c;
            next[q].ooff = at[q].ooff + p * e->os;
            if (last)
                kv_mcopy(job, q, &next[q]);
        }
        if (!last)
            kv_mwalk(job, k + 1, next);
    }
}

typedef struct {
    kv_mjob job;
    kv_at at[KV_MAXP];
} kv_mshare;

static void *kv_mthread(void *arg) {
    const kv_mshare *share = (const kv_mshare *)arg;
    kv_mwalk(&share->job, 0, share->at);
    if (share->job.stream)
        kv_fence_stream();
    return NULL;
}

/* Move one chunk of a cache of `planes` planes in one walk. dims: planes * nd * KV_FIELDS int64
 * values (plane after plane, each outermost dim first); head: 4 int64 per plane, its run bytes,
 * the address of its leaves' address array, the bytes added to each of its leaf addresses (one
 * layer), and its offset in the object. threads and stream as kvgen_move's. Returns 0, or -1
 * for a description it cannot run (the caller then moves the planes one by one). */
int kvgen_move_planes(int store, int nd, int planes, const int64_t *dims, const int64_t *head, char *obj,
                      int threads, int stream) {
    if (nd < 1 || nd > KV_MAXD || planes < 1 || planes > KV_MAXP)
        return -1;
    kv_mshare share;
    memset(&share, 0, sizeof share);
    kv_mjob *job = &share.job;
    job->nd = nd, job->planes = planes, job->store = store, job->stream = stream != 0, job->obj = obj;
    for (int q = 0; q < planes; q++) {
        const int64_t *h = head + 4 * q;
        if (h[0] <= 0)
            return -1;
        job->run[q] = h[0];
        job->leaves[q] = (char *const *)(intptr_t)h[1];
        share.at[q].coff = h[2];
        share.at[q].ooff = h[3];
        for (int k = 0; k < nd; k++) {
            const int64_t *f = dims + ((int64_t)q * nd + k) * KV_FIELDS;
            kv_dim *d = &job->d[q][k];
            d->ext = f[0], d->idx = (const int64_t *)(intptr_t)f[1], d->first = f[2], d->div = f[3];
            d->cs = f[4], d->cs2 = f[5], d->tok = (const int64_t *)(intptr_t)f[6], d->os = f[7], d->ls = f[8];
            d->div2 = f[9], d->cs3 = f[10];
            kv_dim_shifts(d);
            if (d->ext <= 0)
                return 0; /* nothing to move */
        }
    }
    int64_t ext = job->d[0][0].ext;
    if (threads > KV_MAXT)
        threads = KV_MAXT;
    if (threads > ext)
        threads = (int)ext;
    if (threads < 1)
        threads = 1;
    kv_mshare shares[KV_MAXT];
    pthread_t ids[KV_MAXT];
    int started[KV_MAXT];
    for (int t = 0; t < threads; t++) {
        shares[t] = share;
        shares[t].job.lo = ext * t / threads;
        shares[t].job.hi = ext * (t + 1) / threads;
        started[t] = 0;
    }
    if (threads == 1) {
        kv_mthread(&shares[0]);
        return 0;
    }
    if (kv_parallel) {
        kv_team team = {kv_mthread, (char *)shares, sizeof shares[0], threads};
        kv_parallel(kv_team_body, &team, (unsigned)threads, 0);
        return 0;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, kv_mthread, &shares[t]) == 0;
    kv_mthread(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            kv_mthread(&shares[t]);
    }
    return 0;
}

/* -- cache to cache (a layout-to-layout transfer) ------------------------------------------
 *
 * The same nested loops with both sides addressed alike: each dim has 13 int64 fields,
 *   ext, then for the source and then the destination: idx, first, div, cs, cs2, ls
 * (meanings as above; `idx` gives both sides' values v, each side split by its own div).
 * An entry whose source or destination v is < 0 is skipped. Nothing here checks bounds: the
 * transfer checked every slot, block and head range before calling. */
#define KV_PAIR_FIELDS 13

typedef struct {
    int64_t ext;
    const int64_t *idx[2];
    int64_t first[2], div[2], cs[2], cs2[2], ls[2];
    int shift[2]; /* log2 of div where it is a power of two, else -1 */
} kv_pdim;

typedef struct {
    int nd;
    kv_pdim d[KV_MAXD];
    int64_t run;
    char *const *leaves[2];
    int64_t shift[2];
    int64_t lo, hi;
    int stream;
} kv_pjob;

/* Bytes of value v >= 0 on side s of dim d (a slot split by a shift where kv_cache_bytes would). */
static inline int64_t kv_bytes(const kv_pdim *d, int s, int64_t v) {
    if (d->div[s] <= 1)
        return v * d->cs[s];
    if (d->shift[s] >= 0)
        return (v >> d->shift[s]) * d->cs[s] + (v & (d->div[s] - 1)) * d->cs2[s];
    return (v / d->div[s]) * d->cs[s] + (v % d->div[s]) * d->cs2[s];
}

static void kv_pair_walk(const kv_pjob *job, int k, int64_t sl, int64_t so, int64_t dl, int64_t dof) {
    const kv_pdim *d = &job->d[k];
    int64_t lo = k == 0 ? job->lo : 0, hi = k == 0 ? job->hi : d->ext;
    int last = k == job->nd - 1;
    if (last && !d->idx[0] && !d->idx[1] && d->div[0] <= 1 && d->div[1] <= 1 && !d->ls[0] && !d->ls[1]) {
        const char *sp = job->leaves[0][sl] + so + (d->first[0] + lo) * d->cs[0];
        char *dp = job->leaves[1][dl] + dof + (d->first[1] + lo) * d->cs[1];
        for (int64_t i = lo; i < hi; i++, sp += d->cs[0], dp += d->cs[1])
            kv_copy(dp, sp, job->run, job->stream);
        return;
    }
    for (int64_t i = lo; i < hi; i++) {
        int64_t vs = d->idx[0] ? d->idx[0][i] : d->first[0] + i;
        int64_t vd = d->idx[1] ? d->idx[1][i] : d->first[1] + i;
        if (vs < 0 || vd < 0)
            continue;
        int64_t cs = so + kv_bytes(d, 0, vs), cd = dof + kv_bytes(d, 1, vd);
        if (last)
            kv_copy(job->leaves[1][dl + vd * d->ls[1]] + cd, job->leaves[0][sl + vs * d->ls[0]] + cs, job->run,
                    job->stream);
        else
            kv_pair_walk(job, k + 1, sl + vs * d->ls[0], cs, dl + vd * d->ls[1], cd);
    }
}

static void *kv_pair_thread(void *arg) {
    const kv_pjob *job = (const kv_pjob *)arg;
    kv_pair_walk(job, 0, 0, job->shift[0], 0, job->shift[1]);
#if defined(__SSE2__)
    if (job->stream)
        _mm_sfence();
#endif
    return NULL;
}

/* Move one chunk of a transfer. dims: nd * KV_PAIR_FIELDS int64 values, outermost first;
 * run: bytes of the innermost contiguous run (the same on both sides); src, dst: base
 * address of every cache tensor of each side; src_shift, dst_shift: bytes added to every
 * leaf address of that side (one layer); threads share dim 0 as in kvgen_move. Returns 0,
 * or -1 for a description it cannot run (the caller then uses torch). */
int kvgen_transfer(int nd, const int64_t *dims, int64_t run, char *const *src, int64_t src_shift, char *const *dst,
                   int64_t dst_shift, int threads, int stream) {
    if (nd < 1 || nd > KV_MAXD || run <= 0)
        return -1;
    kv_pjob job;
    memset(&job, 0, sizeof job);
    job.nd = nd;
    job.run = run;
    job.leaves[0] = src;
    job.leaves[1] = dst;
    job.shift[0] = src_shift;
    job.shift[1] = dst_shift;
    job.stream = stream != 0;
    for (int k = 0; k < nd; k++) {
        const int64_t *f = dims + (int64_t)k * KV_PAIR_FIELDS;
        kv_pdim *d = &job.d[k];
        d->ext = f[0];
        for (int s = 0; s < 2; s++) {
            const int64_t *g = f + 1 + 6 * s;
            d->idx[s] = (const int64_t *)(intptr_t)g[0];
            d->first[s] = g[1];
            d->div[s] = g[2];
            d->cs[s] = g[3];
            d->cs2[s] = g[4];
            d->ls[s] = g[5];
            d->shift[s] = kv_log2(d->div[s]);
        }
        if (d->ext <= 0)
            return 0; /* nothing to move */
    }
    int64_t ext = job.d[0].ext;
    if (threads > KV_MAXT)
        threads = KV_MAXT;
    if (threads > ext)
        threads = (int)ext;
    if (threads <= 1) {
        job.lo = 0;
        job.hi = ext;
        kv_pair_thread(&job);
        return 0;
    }
    kv_pjob jobs[KV_MAXT];
    pthread_t ids[KV_MAXT];
    int started[KV_MAXT];
    for (int t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].lo = ext * t / threads;
        jobs[t].hi = ext * (t + 1) / threads;
        started[t] = 0;
    }
    if (kv_parallel) {
        kv_team team = {kv_pair_thread, (char *)jobs, sizeof jobs[0], threads};
        kv_parallel(kv_team_body, &team, (unsigned)threads, 0);
        return 0;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, kv_pair_thread, &jobs[t]) == 0;
    kv_pair_thread(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            kv_pair_thread(&jobs[t]);
    }
    return 0;
}

/* What kvgen.runtime.slots.plan_chunk needs to know of one chunk's n slots, in one pass over
 * them (on the CPU this replaces a dozen tensor ops). Fills out[0..8]:
 *   0 low, 1 high          the smallest and largest slot (all n, skipped ones included)
 *   2 moved, 3 first       how many tokens move (slot >= 0, not among the first `skip`) and the first
 *   4 one_run              1 when the moved tokens are consecutive positions
 *   5 run_first, 6 run_tokens  the longest run of whole in-order blocks of `block` slots in the
 *                          moved tokens (block > 0 and one_run only): its first token and its
 *                          token count, or -1 and 0 when there is none
 *   7 consecutive          1 when that run's blocks are consecutive block ids
 *   8 run_slot             the slot of the run's first token (-1 when there is no run)
 * The tests compare it with the torch path it stands for on random mappings. */
void kvgen_slots(const int64_t *slots, int64_t n, int64_t skip, int64_t block, int64_t *out) {
    int64_t low = n ? slots[0] : 0, high = low, moved = 0, first = -1, last = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = slots[i];
        if (v < low)
            low = v;
        if (v > high)
            high = v;
        if (i >= skip && v >= 0) {
            if (first < 0)
                first = i;
            last = i;
            moved++;
        }
    }
    out[0] = low, out[1] = high, out[2] = moved, out[3] = first < 0 ? 0 : first;
    out[4] = moved == 0 || last - first + 1 == moved;
    out[5] = -1, out[6] = 0, out[7] = 0, out[8] = -1;
    if (!out[4] || moved == 0 || block <= 0)
        return;
    int64_t rem = slots[first] % block;
    int64_t start = first + (rem ? block - rem : 0);
    int64_t count = start < first + moved ? (first + moved - start) / block : 0;
    if (count <= 0)
        return;
    int consecutive = 1;
    for (int64_t b = 0; b < count; b++) {
        const int64_t *s = slots + start + b * block;
        if (s[0] % block != 0)
            return;
        for (int64_t j = 1; j < block; j++) /* differences of moved slots (all >= 0) never overflow */
            if (s[j] - s[0] != j)
                return;
        if (s[0] - slots[start] != b * block)
            consecutive = 0;
    }
    out[5] = start, out[6] = count * block, out[7] = consecutive, out[8] = slots[start];
}

static int kv_cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* A slot (>= 0) that two of the n entries of `slots` hold, or -1 when none does: what
 * kvgen.runtime.aliasing.check_unique_slots refuses before a load writes anything. `scratch`
 * holds n int64 and is overwritten (the slots' non-negative entries, sorted). */
int64_t kvgen_repeated_slot(const int64_t *slots, int64_t n, int64_t *scratch) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= 0)
            scratch[m++] = slots[i];
    qsort(scratch, (size_t)m, sizeof scratch[0], kv_cmp);
    for (int64_t i = 1; i < m; i++)
        if (scratch[i] == scratch[i - 1])
            return scratch[i];
    return -1;
}

/* The version of the calling convention above; the loader refuses a library with another. */
int kvgen_abi(void) { return 5; }
