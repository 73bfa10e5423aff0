/*
 * pool.c - VMM device pools: their ids, the one way into a pool, and the
 * calls on a pool as a whole (create, destroy, allocate, free, trim, limit,
 * statistics, devices, lookups, fork).
 *
 * A pool reserves one large address range (cuMemAddressReserve) and cuts it
 * into blocks (block.c); physical memory is mapped into it per granule while
 * live blocks touch it (handle.c). Every pool has one mutex; all operations,
 * CUDA calls included, run under it, which makes each multi-step mapping a
 * transaction other threads never see half-done. Anything that unmaps
 * (scavenging, trim, shrinking a buffer, migration, closing a view or the
 * pool) first waits for every device granted access.
 */
#include "pools.h"

#include <stdlib.h>
#include <string.h>

static pool_t pools[UMP_MAX_POOLS];
/* Guards the slots (used, users; closing is set under the pool's lock too).
 * Taken before a pool's lock, never while holding one, and held while
 * waiting for one only by fork's prepare: a pool's lock may be held across
 * a device synchronisation, which would stall every other pool's calls. */
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
static int n_pools_used;
/* A pool's id is its slot plus UMP_MAX_POOLS times the slot's generation,
 * which moves on when the slot is freed: the id of a destroyed pool never
 * names the pool made next in its slot. Under pools_lock. */
#define POOL_GENERATIONS (1 << 20)
static int pool_gen[UMP_MAX_POOLS];

static int pool_id(const pool_t *p)
{
    int slot = (int)(p - pools);
    return slot + UMP_MAX_POOLS * pool_gen[slot];
}

static int fail(int status) { return ump__set_status(status); }

/* --- pool ids ---------------------------------------------------------------
 * A call turns a pool id into the pool, then takes the pool's lock, and a
 * destroy may run between the two: it frees the pool's arrays and wipes its
 * slot, so the call would lock a destroyed mutex and walk freed lists. So
 * every call, destroy included, first pins the pool under pools_lock
 * (`users`) and then takes the pool's lock. Destroy frees what the pool
 * holds and marks it closing under the pool's lock; a call that pinned it
 * meanwhile sees that once it has the lock, and fails with UMP_ERR_HANDLE.
 * The slot (its lock, its id) goes with the last pin, under pools_lock.
 * Lookups pin the pools they ask the same way. */

/* Under pools_lock: pin the pool of a slot if it is open. */
static int pool_pin(pool_t *p)
{
    int open = p->used && !__atomic_load_n(&p->closing, __ATOMIC_RELAXED);
    p->users += open;
    return open;
}

/* Drop a pin taken under pools_lock; the last pin of a destroyed pool frees
 * its slot. The pool's lock is not held. */
static void pool_unpin(pool_t *p)
{
    pthread_mutex_lock(&pools_lock);
    if (--p->users == 0 && __atomic_load_n(&p->closing, __ATOMIC_RELAXED)) {
        pthread_mutex_destroy(&p->lock);
        memset(p, 0, sizeof *p);
        pool_gen[p - pools] = (pool_gen[p - pools] + 1) % POOL_GENERATIONS;
        __atomic_fetch_sub(&n_pools_used, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pools_lock);
}

/* Let go of a pool from pool_enter: its lock, then the pin. */
static void pool_leave(pool_t *p)
{
    pthread_mutex_unlock(&p->lock);
    pool_unpin(p);
}

/* Pin pool `id` and take its lock (see ump__pool_run for the statuses). */
static int pool_enter(int id, pool_t **out)
{
    *out = NULL;
    if (id < 0 || id >= UMP_MAX_POOLS * POOL_GENERATIONS)
        return UMP_ERR_ARG;
    pool_t *p = &pools[id % UMP_MAX_POOLS];
    pthread_mutex_lock(&pools_lock);
    int open = pool_gen[id % UMP_MAX_POOLS] == id / UMP_MAX_POOLS && pool_pin(p);
    pthread_mutex_unlock(&pools_lock);
    if (!open)
        return UMP_ERR_HANDLE;
    pthread_mutex_lock(&p->lock);
    if (p->closing) {
        pool_leave(p);
        return UMP_ERR_HANDLE;
    }
    *out = p;
    return UMP_OK;
}

int ump__pool_run(int id, ump__pool_op op, void *arg)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status == UMP_OK) {
        status = op(p, arg);
        pool_leave(p);
    }
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* --- create and destroy ---------------------------------------------------- */

/* The arrays and reservation of a new pool in slot p (under pools_lock). */
static int pool_init(pool_t *p, ump__phys_t ph, uint64_t va_bytes, uint64_t limit)
{
    memset(p, 0, sizeof *p);
    p->ph = ph;
    p->main.ngran = (va_bytes + ph.gran - 1) / ph.gran;
    p->main.live = 1;
    p->gref = calloc(p->main.ngran, sizeof *p->gref);
    p->main.gh = malloc(p->main.ngran * sizeof *p->main.gh);
    p->sb = malloc(MAX_STREAM_BINS * sizeof *p->sb);
    int status = p->gref && p->main.gh && p->sb ? UMP_OK : UMP_ERR_NOMEM;
    if (status == UMP_OK) {
        memset(p->main.gh, 0xff, p->main.ngran * sizeof *p->main.gh);
        int pushed;
        status = ump__ph_enter(&p->ph, &pushed);
        if (status == UMP_OK)
            status = ump__ph_reserve(&p->ph, p->main.ngran * ph.gran, &p->main.va);
        ump__ph_leave(&p->ph, pushed);
    }
    if (status != UMP_OK) {
        free(p->gref);
        free(p->main.gh);
        free(p->sb);
        memset(p, 0, sizeof *p);
        return status;
    }
    pthread_mutex_init(&p->lock, NULL);
    p->st.reserved_bytes = p->main.ngran * ph.gran;
    p->st.limit_bytes = limit;
    p->st.granularity = ph.gran;
    p->used = 1;
    return UMP_OK;
}

int ump_vmm_create(int provider, int device, uintptr_t ctx, uint64_t va_bytes, uint64_t limit,
                   int *pool)
{
    if (!pool || (provider != UMP_PROVIDER_HOST && provider != UMP_PROVIDER_DEVICE) ||
        device < 0 || va_bytes == 0 || va_bytes > UMP_VMM_MAX_RESERVE)
        return fail(UMP_ERR_ARG);
    ump__phys_t ph = {.provider = provider, .device = device, .ctx = (void *)ctx, .ndev = 1};
    ph.devs[0] = device;
    int status = ump__ph_granularity(provider, device, (void *)ctx, &ph.gran);
    if (status != UMP_OK)
        return fail(status);
    pthread_mutex_lock(&pools_lock);
    pool_t *p = NULL;
    for (int i = 0; i < UMP_MAX_POOLS && !p; i++)
        if (!pools[i].used)
            p = &pools[i];
    status = p ? pool_init(p, ph, va_bytes, limit) : UMP_ERR_ARG;
    if (status == UMP_OK) {
        __atomic_fetch_add(&n_pools_used, 1, __ATOMIC_RELEASE);
        *pool = pool_id(p);
    }
    pthread_mutex_unlock(&pools_lock);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* Give everything back: only when no block or buffer is live. Destroy pins
 * the pool like any call, so it never holds pools_lock while it waits for
 * the pool's lock, and the slot goes with the last pin (pool ids). */
static int destroy(pool_t *p, void *unused)
{
    (void)unused;
    int status = p->nlive ? UMP_ERR_ARG : UMP_OK;
    for (int b = 0; b < p->nbufs; b++)
        if (p->bufs[b].live)
            status = UMP_ERR_ARG;
    int pushed = 0;
    if (status == UMP_OK)
        status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK)
        status = ump__ph_sync(&p->ph);
    if (status == UMP_OK) {
        for (size_t i = 0; i < p->nh; i++)
            if (p->hs[i].ngran && p->hs[i].region >= 0)
                ump__handle_unmap(p, (int64_t)i);
        ump__release_cached(p, 0);
        ump__ph_unreserve(&p->ph, p->main.va, p->main.ngran * p->ph.gran);
        ump__blocks_destroy(p);
        free(p->hs);
        free(p->gref);
        free(p->main.gh);
        free(p->bufs);
        __atomic_store_n(&p->closing, 1, __ATOMIC_RELAXED);
    }
    ump__ph_leave(&p->ph, pushed);
    return status;
}

int ump_vmm_destroy(int id) { return ump__pool_run(id, destroy, NULL); }

/* --- blocks ---------------------------------------------------------------- */

struct alloc_args {
    uint64_t size;
    uintptr_t stream, ptr;
};

static int alloc(pool_t *p, void *arg)
{
    struct alloc_args *a = arg;
    if (p->ph.inherited)
        return UMP_ERR_FORKED; /* a forked child's copy would hand out the parent's memory */
    if (a->size > p->main.ngran * p->ph.gran)
        return UMP_ERR_RANGE;
    return ump__block_alloc(p, a->size, a->stream, &a->ptr);
}

uintptr_t ump_vmm_alloc(int id, uint64_t size, uintptr_t stream)
{
    struct alloc_args a = {.size = size, .stream = stream};
    return ump__pool_run(id, alloc, &a) == UMP_OK ? a.ptr : 0;
}

static int free_block(pool_t *p, void *ptr) { return ump__block_free(p, *(uintptr_t *)ptr); }

int ump_vmm_free(int id, uintptr_t ptr) { return ump__pool_run(id, free_block, &ptr); }

/* --- physical memory back to the driver ------------------------------------ */

static int trim(pool_t *p, void *keep_handles)
{
    int pushed, status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK) {
        ump__scavenge(p);
        if (!*(int *)keep_handles)
            ump__release_cached(p, 0);
    }
    ump__ph_leave(&p->ph, pushed);
    return status;
}

int ump_vmm_trim(int id, int keep_handles) { return ump__pool_run(id, trim, &keep_handles); }

static int set_limit(pool_t *p, void *arg)
{
    uint64_t limit = *(uint64_t *)arg;
    p->st.limit_bytes = limit;
    int pushed;
    /* Memory over the new limit that no live block uses goes back now, on
     * either physical layer (a forked child's copy gives back nothing). */
    if (limit && p->st.physical_bytes > limit && ump__ph_enter(&p->ph, &pushed) == UMP_OK) {
        ump__scavenge(p);
        ump__release_cached(p, 0);
        ump__ph_leave(&p->ph, pushed);
    }
    return UMP_OK;
}

int ump_vmm_set_limit(int id, uint64_t limit) { return ump__pool_run(id, set_limit, &limit); }

static int stats(pool_t *p, void *arg)
{
    ump_vmm_stats_t *out = arg;
    *out = p->st;
    out->cached_bytes = p->st.physical_bytes - p->st.mapped_bytes - p->st.shared_bytes;
    out->idle_bytes = 0;
    out->handles = 0;
    for (size_t i = 0; i < p->nh; i++) {
        handle_t *e = &p->hs[i];
        if (e->ngran && e->region == 0 && e->busy == 0 && !e->pins)
            out->idle_bytes += e->ngran * p->ph.gran;
        out->handles += e->ngran != 0;
    }
    out->stream_bins = (uint64_t)p->nsb;
    return UMP_OK;
}

int ump_vmm_stats(int id, ump_vmm_stats_t *out)
{
    return out ? ump__pool_run(id, stats, out) : fail(UMP_ERR_ARG);
}

/* --- devices --------------------------------------------------------------- */

static int grant(pool_t *p, void *arg)
{
    int device = *(int *)arg;
    for (int i = 0; i < p->ph.ndev; i++)
        if (p->ph.devs[i] == device)
            return UMP_OK;
    if (p->ph.ndev == UMP_VMM_MAX_DEVICES)
        return UMP_ERR_ARG;
    int pushed;
    p->ph.devs[p->ph.ndev++] = device;
    int status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK)
        status = ump__grant_region(p, &p->main);
    for (int b = 0; b < p->nbufs && status == UMP_OK; b++)
        if (p->bufs[b].live)
            status = ump__grant_region(p, &p->bufs[b]);
    ump__ph_leave(&p->ph, pushed);
    if (status != UMP_OK)
        p->ph.ndev--;
    return status;
}

int ump_vmm_grant(int id, int device)
{
    return device < 0 ? fail(UMP_ERR_ARG) : ump__pool_run(id, grant, &device);
}

struct devices_args {
    int *out, max, *n;
};

static int devices(pool_t *p, void *arg)
{
    struct devices_args *a = arg;
    *a->n = p->ph.ndev;
    for (int i = 0; i < p->ph.ndev && i < a->max; i++)
        a->out[i] = p->ph.devs[i];
    return UMP_OK;
}

int ump_vmm_devices(int id, int *out, int max, int *n)
{
    if (!n || max < 0 || (max && !out))
        return fail(UMP_ERR_ARG);
    struct devices_args a = {out, max, n};
    return ump__pool_run(id, devices, &a);
}

/* --- buffers and views, read ----------------------------------------------- */

struct info_args {
    ump__region_get get;
    int idx, *kind;
    uintptr_t *ptr;
    uint64_t *size;
    ump_vmm_view_times_t *times;
};

static int region_info(pool_t *p, void *arg)
{
    struct info_args *a = arg;
    region_t *r = a->get(p, a->idx);
    if (!r)
        return UMP_ERR_ARG;
    *a->ptr = r->va;
    *a->size = r->size;
    if (a->kind)
        *a->kind = r->kind;
    if (a->times)
        *a->times = r->times;
    return UMP_OK;
}

int ump__region_info(int id, ump__region_get get, int idx, uintptr_t *ptr, uint64_t *size,
                     int *kind, ump_vmm_view_times_t *times)
{
    if (!ptr || !size)
        return fail(UMP_ERR_ARG);
    struct info_args a = {get, idx, kind, ptr, size, times};
    return ump__pool_run(id, region_info, &a);
}

/* --- lookup (for ump_lookup, lookup.c) ------------------------------------ */

/* The live block or region of p holding ptr (under p's lock). */
static int find(pool_t *p, uintptr_t ptr, uintptr_t *base, uint64_t *size)
{
    int region;
    region_t *r = p->closing ? NULL : ump__region_at(p, ptr, &region);
    if (r && region == 0) {
        blk_t *b = ump__block_below(p, ptr - r->va);
        if (b && ptr < r->va + b->off + b->size) {
            *base = r->va + b->off;
            *size = b->size;
            return 1;
        }
    } else if (r && ptr < r->va + r->size) {
        *base = r->va;
        *size = r->size;
        return 1;
    }
    return 0;
}

int ump__vmm_lookup(uintptr_t ptr, uintptr_t *base, uint64_t *size, int *pool)
{
    if (!__atomic_load_n(&n_pools_used, __ATOMIC_ACQUIRE))
        return UMP_KIND_NONE;
    /* Pin the open pools, then ask each under its own lock alone: that lock
     * may be held across a device synchronisation (see pools_lock). */
    pool_t *open[UMP_MAX_POOLS];
    int n = 0;
    pthread_mutex_lock(&pools_lock);
    for (int id = 0; id < UMP_MAX_POOLS; id++)
        if (pool_pin(&pools[id]))
            open[n++] = &pools[id];
    pthread_mutex_unlock(&pools_lock);
    int kind = UMP_KIND_NONE;
    for (int k = 0; k < n; k++) {
        pool_t *p = open[k];
        if (kind != UMP_KIND_NONE) {
            pool_unpin(p);
            continue;
        }
        pthread_mutex_lock(&p->lock);
        if (find(p, ptr, base, size)) {
            kind = p->ph.provider == UMP_PROVIDER_HOST ? UMP_KIND_HOST : UMP_KIND_DEVICE;
            *pool = pool_id(p); /* pinned: its generation holds */
        }
        pool_leave(p);
    }
    return kind;
}

/* --- fork ------------------------------------------------------------------
 * A thread may hold a pool's lock for long (it is held across
 * cuCtxSynchronize and every mapping step); a child forked meanwhile would
 * hang on it at its first free or lookup. common.c holds these locks across
 * fork() (rank UMP_FORK_POOLS). The pool list is stable while pools_lock is
 * held: slots are taken and freed under it. */

static void fork_prepare(void)
{
    pthread_mutex_lock(&pools_lock);
    for (int id = 0; id < UMP_MAX_POOLS; id++)
        if (pools[id].used)
            pthread_mutex_lock(&pools[id].lock);
}

static void fork_parent(void)
{
    for (int id = UMP_MAX_POOLS - 1; id >= 0; id--)
        if (pools[id].used)
            pthread_mutex_unlock(&pools[id].lock);
    pthread_mutex_unlock(&pools_lock);
}

/* The child's only thread is the one that forked: no other holder exists,
 * so fresh locks are exact, and every pin was another thread's. */
static void fork_child(void)
{
    for (int id = 0; id < UMP_MAX_POOLS; id++) {
        pool_t *p = &pools[id];
        if (!p->used)
            continue;
        p->users = 0;
        if (p->closing) {
            memset(p, 0, sizeof *p);
            n_pools_used--;
        } else {
            pthread_mutex_init(&p->lock, NULL);
            p->ph.inherited = 1;
        }
    }
    pthread_mutex_init(&pools_lock, NULL);
}

__attribute__((constructor)) static void pools_init(void)
{
    ump__on_fork(UMP_FORK_POOLS, fork_prepare, fork_parent, fork_child);
}
