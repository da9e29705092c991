/* Strided copies of many same-shaped items: KV blocks between kvstore's slots and an engine's
 * paged cache on the CPU (kvstore.tiers.cpu_copy).
 *
 * Items come in groups; every item of a group is one view of `nd` dims, `shape`, with byte
 * strides `ds` on the destination and `ss` on the source, and only its base addresses differ
 * (`dst[i]`, `src[i]`). One call moves every (layer, half) of a load. The caller orders
 * the dims (destination strides falling) and merges those that are contiguous on both sides,
 * so the innermost dim is a memcpy where both sides are dense there, and otherwise a typed
 * strided loop (a transposed K page: sequential writes, gathered reads).
 *
 * The caller checks every address against its buffers; this file trusts them. Built as a plain
 * shared library (scripts/build_kvcodec.sh) and called through ctypes, which releases the GIL
 * for the call. `threads` > 1 splits the items over that many threads (the caller's is one).
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAXD 8
#define MAXT 16

/* One group of items, as the caller's descriptor holds it: n, nd, shape[MAXD], ds[MAXD], ss[MAXD]. */
#define DESC (2 + 3 * MAXD)

struct group {
    int64_t n;
    int nd;
    const int64_t *shape, *ds, *ss;
};

#define STRIDED(T)                                                                   \
    do {                                                                             \
        T *d_ = (T *)d;                                                              \
        const uint8_t *s_ = s;                                                       \
        for (int64_t k_ = 0; k_ < n; k_++, d_ = (T *)((uint8_t *)d_ + dstep), s_ += sstep) \
            memcpy(d_, s_, sizeof(T));                                               \
    } while (0)

/* The innermost dim: `n` elements of `es` bytes. */
static void inner(uint8_t *d, const uint8_t *s, int64_t n, int64_t dstep, int64_t sstep, int es) {
    if (dstep == es && sstep == es) {
        memcpy(d, s, (size_t)(n * es));
        return;
    }
    switch (es) {
    case 1: STRIDED(uint8_t); break;
    case 2: STRIDED(uint16_t); break;
    case 4: STRIDED(uint32_t); break;
    case 8: STRIDED(uint64_t); break;
    default:
        for (int64_t k = 0; k < n; k++)
            memcpy(d + k * dstep, s + k * sstep, (size_t)es);
    }
}

static void item(uint8_t *d, const uint8_t *s, const struct group *g, int es) {
    int last = g->nd - 1;
    int64_t at[MAXD] = {0};
    for (;;) {
        inner(d, s, g->shape[last], g->ds[last], g->ss[last], es);
        int k = last - 1;
        for (; k >= 0; k--) { /* odometer over the outer dims */
            d += g->ds[k];
            s += g->ss[k];
            if (++at[k] < g->shape[k])
                break;
            d -= g->ds[k] * g->shape[k];
            s -= g->ss[k] * g->shape[k];
            at[k] = 0;
        }
        if (k < 0)
            return;
    }
}

struct job {
    const struct group *groups;
    int ngroups, es;
    const int64_t *dst, *src;
    int64_t first, end; /* items, counted across the groups */
};

static void *run(void *arg) {
    const struct job *j = arg;
    int64_t base = 0;
    for (int g = 0; g < j->ngroups; g++) {
        const struct group *gr = &j->groups[g];
        int64_t lo = j->first > base ? j->first : base;
        int64_t hi = j->end < base + gr->n ? j->end : base + gr->n;
        for (int64_t i = lo; i < hi; i++)
            item((uint8_t *)(uintptr_t)j->dst[i], (const uint8_t *)(uintptr_t)j->src[i], gr, j->es);
        base += gr->n;
    }
    return NULL;
}

/* Copy the items of `ngroups` groups (descriptors of DESC int64 each, back to back), item i of
 * them all from src[i] to dst[i]; 0, or -1 when a descriptor is out of range (nothing copied). */
int kvc_copy(int ngroups, const int64_t *desc, const int64_t *dst, const int64_t *src, int es, int threads) {
    enum { MAXG = 256 };
    struct group groups[MAXG];
    if (ngroups < 0 || ngroups > MAXG || es < 1)
        return -1;
    int64_t total = 0;
    for (int g = 0; g < ngroups; g++) {
        const int64_t *d = desc + (size_t)g * DESC;
        groups[g] = (struct group){d[0], (int)d[1], d + 2, d + 2 + MAXD, d + 2 + 2 * MAXD};
        if (d[0] < 0 || d[1] < 1 || d[1] > MAXD)
            return -1;
        for (int k = 0; k < d[1]; k++)
            if (groups[g].shape[k] < 1)
                return -1;
        total += d[0];
    }
    if (threads < 1)
        threads = 1;
    if (threads > MAXT)
        threads = MAXT;
    if (threads > total)
        threads = total > 0 ? (int)total : 1;
    struct job jobs[MAXT];
    pthread_t tid[MAXT];
    int started[MAXT] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){groups, ngroups, es, dst, src, total * t / threads, total * (t + 1) / threads};
        if (t > 0)
            started[t] = pthread_create(&tid[t], NULL, run, &jobs[t]) == 0;
    }
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run(&jobs[t]); /* no thread to be had: this one copies its share */
    }
    return 0;
}
