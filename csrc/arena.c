/*
 * arena.c - size-class arenas over large chunks, the registry of its chunks, the
 * plain aligned fallback, and the NEP 49 hooks NumPy calls.
 *
 * Layout. Requests up to 1 MiB are served from slabs: a chunk of one size
 * class cut into equal slots (512-byte multiples, at most 12.5 % internal
 * waste). Larger requests get a run of their own (64 KiB grain); freed runs
 * are cached and reused for requests within 12.5 % of their size. Empty slabs
 * and cached runs go back to the provider on ump_arena_trim() or when the cap
 * would otherwise be exceeded.
 *
 * Metadata never lives inside the blocks: a managed chunk written by the CPU
 * would migrate to the host, and device memory cannot be written at all.
 *
 * Locks. The thread caches' list, then the registry (rwlock), then an arena
 * (mutex), always. The allocation fast path takes only the arena mutex (or,
 * through a thread cache, none); provider calls are made with no lock held.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define N_CLASSES 72
#define SMALL_MAX ((size_t)1 << 20)
#define LARGE_GRAIN ((size_t)64 << 10)
#define SLAB_MIN ((size_t)2 << 20)
#define SLAB_MIN_SLOTS 16

typedef struct arena arena_t;

typedef struct chunk {
    uintptr_t base;
    size_t size;             /* bytes taken from the provider */
    arena_t *arena;
    int cls;                 /* size class, -1 for a large run */
    size_t block;            /* slot size, or the run's capacity */
    size_t used;             /* large: bytes handed out */
    int in_use;              /* large: handed out */
    int zero;                /* large: untouched since the provider zeroed it */
    uint32_t nslots, nfree;
    uint32_t *free_stack;    /* slab: free slot indices */
    uint64_t *live;          /* slab: one bit per slot, set while handed out */
    struct chunk *next, *prev;
} chunk_t;

/* What a backend's memory may take: held against cap, shared by the
 * NumPy-side and CuPy-side arenas of one kind and device. */
typedef struct budget {
    int kind, device; /* device -1: the backend's main budget */
    uint64_t held, cap;
} budget_t;

struct arena {
    int id, kind, provider, flags; /* UMP_ARENA_* */
    void *ctx;                     /* CUcontext chunks are made under; NULL: ump's */
    budget_t *budget;
    pthread_mutex_t lock;
    chunk_t *partial[N_CLASSES]; /* slabs with at least one free slot */
    chunk_t *runs;               /* cached free large runs */
    ump_stats_t st;
    uint64_t tc_bytes, tc_count; /* in thread caches, as their threads last told (arena_st_alloc) */
};

/* One budget per kind and device: the NumPy-side and CuPy-side arenas of a
 * backend share its cap, so the cap bounds all the memory the backend holds
 * there. Entries are never removed (arenas live as long as the process). */
static budget_t budgets[UMP_MAX_ARENAS];
static int budget_count;

static arena_t *arenas[UMP_MAX_ARENAS];
static int n_arenas;
static pthread_mutex_t arenas_lock = PTHREAD_MUTEX_INITIALIZER;
static int numpy_arena = -1;

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static uint64_t reg_gen; /* bumped, under reg_lock, whenever a chunk leaves */
static chunk_t **reg;
static size_t reg_n, reg_cap;
static uint64_t foreign_frees;

uint64_t ump_foreign_frees(void) { return __atomic_load_n(&foreign_frees, __ATOMIC_RELAXED); }

static size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

/* --- size classes ------------------------------------------------------ */

/* 512, 1024, ..., 4096, then eight steps per power of two up to 1 MiB. */
static int class_of(size_t rsize)
{
    if (rsize <= 4096)
        return (int)(rsize / UMP_ALIGN) - 1;
    int p = 63 - __builtin_clzll((unsigned long long)(rsize - 1));
    size_t step = (size_t)1 << (p - 3);
    size_t j = (rsize - ((size_t)1 << p) + step - 1) / step;
    return 8 + (p - 12) * 8 + (int)j - 1;
}

static size_t class_size(int cls)
{
    if (cls < 8)
        return (size_t)(cls + 1) * UMP_ALIGN;
    int p = 12 + (cls - 8) / 8;
    size_t j = (size_t)((cls - 8) % 8) + 1;
    return ((size_t)1 << p) + j * ((size_t)1 << (p - 3));
}

static size_t slab_bytes(size_t block)
{
    size_t want = block * SLAB_MIN_SLOTS;
    return want < SLAB_MIN ? SLAB_MIN : round_up(want, SLAB_MIN);
}

/* --- registry ------------------------------------------------------------ */

/* Index of the last chunk whose base <= p, or -1. Caller holds reg_lock. */
static long reg_floor(uintptr_t p)
{
    long lo = 0, hi = (long)reg_n - 1, ans = -1;
    while (lo <= hi) {
        long mid = lo + (hi - lo) / 2;
        if (reg[mid]->base <= p) {
            ans = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return ans;
}

static chunk_t *reg_find(uintptr_t p)
{
    long i = reg_floor(p);
    if (i < 0)
        return NULL;
    chunk_t *c = reg[i];
    return p < c->base + c->size ? c : NULL;
}

/* Caller holds reg_lock for writing. */
static int reg_insert(chunk_t *c)
{
    if (reg_n == reg_cap) {
        size_t ncap = reg_cap ? reg_cap * 2 : 64;
        chunk_t **n = realloc(reg, ncap * sizeof *n);
        if (!n)
            return UMP_ERR_NOMEM;
        reg = n;
        reg_cap = ncap;
    }
    long at = reg_floor(c->base) + 1;
    memmove(&reg[at + 1], &reg[at], (reg_n - (size_t)at) * sizeof *reg);
    reg[at] = c;
    reg_n++;
    return UMP_OK;
}

static void reg_remove(chunk_t *c)
{
    __atomic_fetch_add(&reg_gen, 1, __ATOMIC_RELEASE);
    long i = reg_floor(c->base);
    if (i >= 0 && reg[i] == c) {
        memmove(&reg[i], &reg[i + 1], (reg_n - (size_t)i - 1) * sizeof *reg);
        reg_n--;
    }
}

/* --- lists --------------------------------------------------------------- */

static void list_push(chunk_t **head, chunk_t *c)
{
    c->prev = NULL;
    c->next = *head;
    if (*head)
        (*head)->prev = c;
    *head = c;
}

static void list_unlink(chunk_t **head, chunk_t *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        *head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next = c->prev = NULL;
}

/* --- statistics (caller holds the arena lock) ---------------------------- */

static uint64_t sat_sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }

static void st_peak(ump_stats_t *st, uint64_t bytes, uint64_t count)
{
    if (bytes > st->peak_bytes)
        st->peak_bytes = bytes;
    if (count > st->peak_count)
        st->peak_count = count;
}

/* Count a block handed out. The peak leaves out `idle_*`: blocks counted in
 * current_* that are free for users (in thread caches). */
static void st_alloc(ump_stats_t *st, size_t bytes, uint64_t idle_bytes, uint64_t idle_count)
{
    st->current_bytes += bytes;
    st->total_bytes += bytes;
    st->current_count++;
    st->total_count++;
    st_peak(st, sat_sub(st->current_bytes, idle_bytes), sat_sub(st->current_count, idle_count));
}

static void st_free(ump_stats_t *st, size_t bytes)
{
    st->current_bytes -= bytes;
    st->current_count--;
}

/* Give slot idx back to slab c. Caller holds the arena lock and has cleared
 * the slot's live bit (or it was cleared when a thread cache took it). */
static void slab_put(arena_t *a, chunk_t *c, uint32_t idx)
{
    c->free_stack[c->nfree++] = idx;
    if (c->nfree == 1)
        list_push(&a->partial[c->cls], c);
    if (c->nfree == c->nslots)
        a->st.cached_bytes += c->size; /* wholly free: trim may take it */
    st_free(&a->st, c->block);
}

/* --- per-thread cache of small blocks ------------------------------------
 * NumPy allocates and frees small arrays constantly; NumPy's own handler keeps
 * a cache for them. Each thread keeps up to TC_DEPTH free blocks per class up
 * to 4 KiB of the NumPy arena, so that malloc and free take no lock:
 * - a cached block has its live bit cleared (lookups and double frees see it
 *   as free) but is not on its slab's free stack, so the slab is not wholly
 *   free and trim cannot take the chunk from under it;
 * - free finds the block's chunk among the thread's hints (the slab each class
 *   last took a block from); the hints are valid while no chunk has left the
 *   registry since they were taken (reg_gen).
 * Only its own thread touches a cache: it goes back to its slabs at thread
 * exit, and when its thread next allocates through the hooks after the NumPy
 * arena changed, reads the arena's statistics or trims it. Statistics count
 * cached blocks as free and blocks taken from a cache as allocated, from
 * per-thread counters (the fast path writes nothing shared) that a flush
 * folds into the arena's. */

#define TC_CLASSES 8
#define TC_DEPTH 32

typedef struct tcache {
    arena_t *arena;
    uint64_t gen;
    int registered;
    /* Written by the owner thread only (relaxed stores, no read-modify-write),
     * read by statistics in other threads under tc_list_lock: bytes and
     * blocks cached, and bytes and blocks handed out from the cache since the
     * last flush. */
    uint64_t bytes, count, alloc_bytes, allocs;
    uint64_t pub_bytes, pub_count; /* the part of bytes, count in arena->tc_* */
    struct tcache *next, *prev;    /* all registered caches, under tc_list_lock */
    /* Per class, the hinted slab and a copy of its bounds taken under the
     * arena lock: another thread's trim may free the chunk_t (tc_put). */
    chunk_t *hint[TC_CLASSES];
    uintptr_t hint_lo[TC_CLASSES], hint_hi[TC_CLASSES];
    uint32_t n[TC_CLASSES];
    struct { void *p; chunk_t *c; } slot[TC_CLASSES][TC_DEPTH];
} tcache_t;

static __thread tcache_t tc;
static pthread_key_t tc_key;
static pthread_mutex_t tc_list_lock = PTHREAD_MUTEX_INITIALIZER;
static tcache_t *tc_list;

/* Store one of this thread's counters that statistics read. */
static void tc_set(uint64_t *counter, uint64_t value) { __atomic_store_n(counter, value, __ATOMIC_RELAXED); }

static void tc_forget_hints(void)
{
    memset(tc.hint, 0, sizeof tc.hint);
    memset(tc.hint_lo, 0, sizeof tc.hint_lo);
    memset(tc.hint_hi, 0, sizeof tc.hint_hi);
}

/* Return this thread's cached blocks to their slabs and fold its counters
 * into the arena's statistics. */
static void tc_flush(void)
{
    arena_t *a = tc.arena;
    if (a) {
        /* Statistics take tc_list_lock, then the arena lock (fork's order):
         * holding both, the flush is one step for them, so no block counts
         * as both cached and in its slab, or as neither. */
        pthread_mutex_lock(&tc_list_lock);
        pthread_mutex_lock(&a->lock);
        for (int cls = 0; cls < TC_CLASSES; cls++) {
            for (uint32_t i = 0; i < tc.n[cls]; i++) {
                chunk_t *c = tc.slot[cls][i].c;
                slab_put(a, c, (uint32_t)(((uintptr_t)tc.slot[cls][i].p - c->base) / c->block));
            }
            tc.n[cls] = 0;
        }
        a->st.total_bytes += tc.alloc_bytes;
        a->st.total_count += tc.allocs;
        a->tc_bytes -= tc.pub_bytes;
        a->tc_count -= tc.pub_count;
        tc.pub_bytes = tc.pub_count = 0;
        tc_set(&tc.bytes, 0);
        tc_set(&tc.count, 0);
        tc_set(&tc.alloc_bytes, 0);
        tc_set(&tc.allocs, 0);
        __atomic_store_n(&tc.arena, NULL, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&a->lock);
        pthread_mutex_unlock(&tc_list_lock);
    }
    tc_forget_hints();
}

static void tc_thread_exit(void *unused)
{
    (void)unused;
    tc_flush();
    pthread_mutex_lock(&tc_list_lock);
    if (tc.prev)
        tc.prev->next = tc.next;
    else
        tc_list = tc.next;
    if (tc.next)
        tc.next->prev = tc.prev;
    pthread_mutex_unlock(&tc_list_lock);
}

/* Bind this thread's cache to arena a (flushing another arena's blocks). */
static void tc_bind(arena_t *a)
{
    if (tc.arena != a)
        tc_flush();
    __atomic_store_n(&tc.arena, a, __ATOMIC_RELAXED);
    if (!tc.registered) {
        tc.registered = 1;
        pthread_mutex_lock(&tc_list_lock);
        tc.prev = NULL;
        tc.next = tc_list;
        if (tc_list)
            tc_list->prev = &tc;
        tc_list = &tc;
        pthread_mutex_unlock(&tc_list_lock);
        pthread_setspecific(tc_key, &tc); /* so tc_thread_exit runs */
    }
}

/* Remember that class cls of arena a served from slab s. Caller holds a's
 * lock, so s cannot leave the registry before the generation is read. */
static void tc_hint(arena_t *a, chunk_t *s)
{
    if (tc.arena != a || s->cls >= TC_CLASSES)
        return;
    uint64_t gen = __atomic_load_n(&reg_gen, __ATOMIC_ACQUIRE);
    if (gen != tc.gen) {
        tc_forget_hints(); /* older hints may be stale */
        tc.gen = gen;
    }
    tc.hint[s->cls] = s;
    tc.hint_lo[s->cls] = s->base;
    tc.hint_hi[s->cls] = s->base + s->size;
}

static void *tc_take(arena_t *a, int cls)
{
    if (cls >= TC_CLASSES || tc.arena != a || tc.n[cls] == 0)
        return NULL;
    uint32_t i = --tc.n[cls];
    chunk_t *c = tc.slot[cls][i].c;
    void *p = tc.slot[cls][i].p;
    uint32_t idx = (uint32_t)(((uintptr_t)p - c->base) / c->block);
    __atomic_fetch_or(&c->live[idx / 64], (uint64_t)1 << (idx % 64), __ATOMIC_RELAXED);
    tc_set(&tc.bytes, tc.bytes - c->block);
    tc_set(&tc.count, tc.count - 1);
    tc_set(&tc.alloc_bytes, tc.alloc_bytes + c->block);
    tc_set(&tc.allocs, tc.allocs + 1);
    return p;
}

/* Cache a freed block if it is in one of this thread's hinted slabs. Returns
 * 1 if cached; 0 sends the free down the locked path (which also reports
 * double and interior frees). */
static int tc_put(void *ptr)
{
    if (!tc.arena || tc.gen != __atomic_load_n(&reg_gen, __ATOMIC_ACQUIRE))
        return 0;
    uintptr_t p = (uintptr_t)ptr;
    for (int cls = 0; cls < TC_CLASSES; cls++) {
        /* The copied bounds, not the chunk_t: right after the generation
         * check another thread's trim may free a hinted slab that is wholly
         * free. A slab holding p is not (p is live, unless this is a double
         * free racing the trim), so the chunk_t is read only then. */
        if (p < tc.hint_lo[cls] || p >= tc.hint_hi[cls])
            continue;
        chunk_t *c = tc.hint[cls];
        uintptr_t off = p - c->base;
        if (off % c->block || tc.n[cls] == TC_DEPTH)
            return 0;
        uint32_t idx = (uint32_t)(off / c->block);
        uint64_t bit = (uint64_t)1 << (idx % 64);
        if (!(__atomic_fetch_and(&c->live[idx / 64], ~bit, __ATOMIC_RELAXED) & bit))
            return 0; /* was not live: a double free, reported by the slow path */
        tc.slot[cls][tc.n[cls]].p = ptr;
        tc.slot[cls][tc.n[cls]].c = c;
        tc.n[cls]++;
        tc_set(&tc.bytes, tc.bytes + c->block);
        tc_set(&tc.count, tc.count + 1);
        return 1;
    }
    return 0;
}

/* --- arenas -------------------------------------------------------------- */

static arena_t *arena_get(int id)
{
    if (id < 0 || id >= UMP_MAX_ARENAS)
        return NULL;
    return __atomic_load_n(&arenas[id], __ATOMIC_ACQUIRE);
}

/* Every flag of UMP_ARENA_FLAGS: those an arena may have. */
#define FLAG_BIT(name, value) | (value)
#define ALL_FLAGS (0 UMP_ARENA_FLAGS(FLAG_BIT))

/* The budget of (kind, device), made if new; under arenas_lock. */
static budget_t *budget_of(int kind, int device)
{
    for (int i = 0; i < budget_count; i++)
        if (budgets[i].kind == kind && budgets[i].device == device)
            return &budgets[i];
    budget_t *b = &budgets[budget_count++]; /* one arena at least per budget: room */
    b->kind = kind;
    b->device = device;
    return b;
}

int ump_arena_create(int kind, int provider, uint64_t cap_bytes, int flags, int device,
                     uintptr_t ctx, int *id)
{
    /* Arenas take chunks from every provider but the VMM pools'. */
    if (!id || kind <= UMP_KIND_NONE || kind >= UMP_KIND_END || provider < 0 ||
        provider > UMP_PROVIDER_PINNED || (flags & ~ALL_FLAGS) || device < -1 ||
        (ctx && provider == UMP_PROVIDER_HOST))
        return ump__set_status(UMP_ERR_ARG);
    pthread_mutex_lock(&arenas_lock);
    /* Arenas live as long as the process: blocks may outlive disable(), and
     * enabling the same backend again reuses its arena and cached chunks. */
    for (int i = 0; i < n_arenas; i++) {
        arena_t *a = arenas[i];
        if (a->kind == kind && a->provider == provider && a->flags == flags &&
            a->budget->device == device && a->ctx == (void *)ctx) {
            __atomic_store_n(&a->budget->cap, cap_bytes, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&arenas_lock);
            *id = i;
            return UMP_OK;
        }
    }
    if (n_arenas == UMP_MAX_ARENAS) {
        pthread_mutex_unlock(&arenas_lock);
        return ump__set_status(UMP_ERR_ARG);
    }
    arena_t *a = calloc(1, sizeof *a);
    if (!a) {
        pthread_mutex_unlock(&arenas_lock);
        return ump__set_status(UMP_ERR_NOMEM);
    }
    a->id = n_arenas;
    a->kind = kind;
    a->provider = provider;
    a->flags = flags;
    a->ctx = (void *)ctx;
    a->budget = budget_of(kind, device);
    __atomic_store_n(&a->budget->cap, cap_bytes, __ATOMIC_RELAXED);
    pthread_mutex_init(&a->lock, NULL);
    __atomic_store_n(&arenas[n_arenas], a, __ATOMIC_RELEASE);
    *id = n_arenas++;
    pthread_mutex_unlock(&arenas_lock);
    return UMP_OK;
}

int ump_arena_set_cap(int id, uint64_t cap_bytes)
{
    arena_t *a = arena_get(id);
    if (!a)
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&a->budget->cap, cap_bytes, __ATOMIC_RELAXED);
    return UMP_OK;
}

int ump_arena_stats(int id, ump_stats_t *out)
{
    arena_t *a = arena_get(id);
    if (!a || !out)
        return ump__set_status(UMP_ERR_ARG);
    if (tc.arena == a)
        tc_flush();
    /* Blocks in thread caches count as allocated in st but are free for
     * users; blocks taken from them are not in st's totals yet. Flushes hold
     * both locks, so st and the counters agree; other threads' fast paths
     * still move theirs as they are read: saturate rather than wrap. */
    uint64_t bytes = 0, count = 0, alloc_bytes = 0, allocs = 0;
    pthread_mutex_lock(&tc_list_lock);
    pthread_mutex_lock(&a->lock);
    for (tcache_t *t = tc_list; t; t = t->next) {
        if (__atomic_load_n(&t->arena, __ATOMIC_RELAXED) != a)
            continue;
        bytes += __atomic_load_n(&t->bytes, __ATOMIC_RELAXED);
        count += __atomic_load_n(&t->count, __ATOMIC_RELAXED);
        alloc_bytes += __atomic_load_n(&t->alloc_bytes, __ATOMIC_RELAXED);
        allocs += __atomic_load_n(&t->allocs, __ATOMIC_RELAXED);
    }
    *out = a->st;
    out->current_bytes = sat_sub(out->current_bytes, bytes);
    out->current_count = sat_sub(out->current_count, count);
    out->total_bytes += alloc_bytes;
    out->total_count += allocs;
    /* A high reached through thread caches alone is seen only here. */
    st_peak(&a->st, out->current_bytes, out->current_count);
    out->peak_bytes = a->st.peak_bytes;
    out->peak_count = a->st.peak_count;
    pthread_mutex_unlock(&a->lock);
    pthread_mutex_unlock(&tc_list_lock);
    out->cap_bytes = __atomic_load_n(&a->budget->cap, __ATOMIC_RELAXED);
    return UMP_OK;
}

static void chunk_destroy(chunk_t *c)
{
    free(c->free_stack);
    free(c->live);
    free(c);
}

/* Give every wholly free chunk of the arena back to its provider. */
int ump_arena_trim(int id)
{
    arena_t *a = arena_get(id);
    if (!a)
        return ump__set_status(UMP_ERR_ARG);
    chunk_t *victims = NULL;
    if (tc.arena == a)
        tc_flush();
    pthread_rwlock_wrlock(&reg_lock);
    pthread_mutex_lock(&a->lock);
    for (int cls = 0; cls < N_CLASSES; cls++) {
        chunk_t *c = a->partial[cls];
        while (c) {
            chunk_t *next = c->next;
            if (c->nfree == c->nslots) {
                list_unlink(&a->partial[cls], c);
                list_push(&victims, c);
            }
            c = next;
        }
    }
    while (a->runs) {
        chunk_t *c = a->runs;
        list_unlink(&a->runs, c);
        list_push(&victims, c);
    }
    for (chunk_t *c = victims; c; c = c->next) {
        reg_remove(c);
        __atomic_fetch_sub(&a->budget->held, c->size, __ATOMIC_RELAXED);
        a->st.held_bytes -= c->size;
        a->st.cached_bytes -= c->size;
        a->st.chunk_frees++;
    }
    pthread_mutex_unlock(&a->lock);
    pthread_rwlock_unlock(&reg_lock);
    int status = UMP_OK;
    while (victims) {
        chunk_t *c = victims;
        victims = c->next;
        int s = ump__provider_free(a->provider, (void *)c->base, c->size, a->ctx);
        if (s != UMP_OK)
            status = s;
        chunk_destroy(c);
    }
    return status == UMP_OK ? UMP_OK : ump__set_status(status);
}

/* Take `bytes` of a budget if they fit under its cap. */
static int budget_take(budget_t *b, uint64_t bytes)
{
    uint64_t held = __atomic_load_n(&b->held, __ATOMIC_RELAXED);
    do {
        if (held + bytes < held || held + bytes > __atomic_load_n(&b->cap, __ATOMIC_RELAXED))
            return 0;
    } while (!__atomic_compare_exchange_n(&b->held, &held, held + bytes, 1,
                                          __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return 1;
}

/* Wholly free bytes of arena a (under its lock). */
static uint64_t cached_of(arena_t *a)
{
    pthread_mutex_lock(&a->lock);
    uint64_t bytes = a->st.cached_bytes;
    pthread_mutex_unlock(&a->lock);
    return bytes;
}

/* Reserve `bytes` of the arena's budget, trimming cached chunks once if the
 * cap would be exceeded. */
static int reserve(arena_t *a, size_t bytes)
{
    budget_t *b = a->budget;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (budget_take(b, bytes)) {
            pthread_mutex_lock(&a->lock);
            a->st.held_bytes += bytes;
            pthread_mutex_unlock(&a->lock);
            return UMP_OK;
        }
        if (attempt == 1)
            break;
        /* Trim the budget's arenas (both sides of the backend) if their
         * wholly free chunks together cover the shortfall: trimming for less
         * would give chunks back and fail anyway, thrashing the provider at
         * the cap. */
        uint64_t held = __atomic_load_n(&b->held, __ATOMIC_RELAXED);
        uint64_t cap = __atomic_load_n(&b->cap, __ATOMIC_RELAXED);
        uint64_t need = held + bytes < held ? UINT64_MAX : sat_sub(held + bytes, cap);
        uint64_t cached = 0;
        for (int i = 0; i < UMP_MAX_ARENAS; i++) {
            arena_t *other = arena_get(i);
            if (other && other->budget == b)
                cached += cached_of(other);
        }
        if (cached < need)
            break;
        for (int i = 0; i < UMP_MAX_ARENAS; i++) {
            arena_t *other = arena_get(i);
            if (other && other->budget == b && cached_of(other))
                ump_arena_trim(i);
        }
    }
    return UMP_ERR_CAP;
}

static void unreserve(arena_t *a, size_t bytes, int failed)
{
    __atomic_fetch_sub(&a->budget->held, bytes, __ATOMIC_RELAXED);
    pthread_mutex_lock(&a->lock);
    a->st.held_bytes -= bytes;
    if (failed)
        a->st.failures++;
    pthread_mutex_unlock(&a->lock);
}

/* A new chunk from the provider, registered; not yet on any arena list. */
static chunk_t *new_chunk(arena_t *a, size_t bytes, int cls, size_t block)
{
    int status = reserve(a, bytes);
    if (status != UMP_OK) {
        unreserve(a, 0, 1);
        ump__set_status(status);
        return NULL;
    }
    chunk_t *c = calloc(1, sizeof *c);
    if (c && cls >= 0) {
        c->nslots = (uint32_t)(bytes / block);
        c->free_stack = malloc(c->nslots * sizeof *c->free_stack);
        c->live = calloc((c->nslots + 63) / 64, sizeof *c->live);
        if (!c->free_stack || !c->live) {
            chunk_destroy(c);
            c = NULL;
        }
    }
    if (!c) {
        unreserve(a, bytes, 1);
        ump__set_status(UMP_ERR_NOMEM);
        return NULL;
    }
    void *mem = NULL;
    int zero = 0;
    status = ump__injected_failure();
    if (status == UMP_OK)
        status = ump__provider_alloc(a->provider, bytes, &mem, &zero, a->ctx);
    if (status != UMP_OK) {
        chunk_destroy(c);
        unreserve(a, bytes, 1);
        ump__set_status(status);
        return NULL;
    }
    if (a->flags & UMP_ARENA_ADVISE_HOST)
        ump__advise_host(mem, bytes);
    else if ((a->flags & UMP_ARENA_CUPY) && a->provider == UMP_PROVIDER_MANAGED)
        ump__populate_gpu(mem, bytes, a->budget->device, a->ctx);
    c->base = (uintptr_t)mem;
    c->size = bytes;
    c->arena = a;
    c->cls = cls;
    c->block = block;
    c->zero = zero;
    if (cls >= 0) {
        c->nfree = c->nslots;
        /* pop from the end: slot 0 is handed out first */
        for (uint32_t i = 0; i < c->nslots; i++)
            c->free_stack[i] = c->nslots - 1 - i;
    }
    pthread_rwlock_wrlock(&reg_lock);
    status = reg_insert(c);
    pthread_rwlock_unlock(&reg_lock);
    if (status != UMP_OK) {
        ump__provider_free(a->provider, mem, bytes, a->ctx);
        chunk_destroy(c);
        unreserve(a, bytes, 1);
        ump__set_status(status);
        return NULL;
    }
    pthread_mutex_lock(&a->lock);
    a->st.chunk_allocs++;
    pthread_mutex_unlock(&a->lock);
    return c;
}

/* Count a block of arena a handed out; caller holds a's lock. The peak
 * leaves out blocks in thread caches (free for users, yet in st.current) as
 * their threads last told the arena, here: it cannot sum the caches itself
 * without tc_list_lock, which ranks before the arena lock. So other threads'
 * caches count as of their last allocation under the lock, and a high
 * reached through caches alone is recorded when statistics are read. */
static void arena_st_alloc(arena_t *a, size_t bytes)
{
    if (tc.arena == a) {
        a->tc_bytes += tc.bytes - tc.pub_bytes;
        a->tc_count += tc.count - tc.pub_count;
        tc.pub_bytes = tc.bytes;
        tc.pub_count = tc.count;
    }
    st_alloc(&a->st, bytes, a->tc_bytes, a->tc_count);
}

/* Caller holds the arena lock; s has a free slot. */
static void *slab_take(arena_t *a, chunk_t *s)
{
    uint32_t idx = s->free_stack[--s->nfree];
    __atomic_fetch_or(&s->live[idx / 64], (uint64_t)1 << (idx % 64), __ATOMIC_RELAXED);
    if (s->nfree == s->nslots - 1)
        a->st.cached_bytes -= s->size; /* was wholly free */
    if (s->nfree == 0)
        list_unlink(&a->partial[s->cls], s);
    arena_st_alloc(a, s->block);
    return (void *)(s->base + (uintptr_t)idx * s->block);
}

static void *slab_alloc(arena_t *a, int cls)
{
    size_t block = class_size(cls);
    for (int attempt = 0; attempt < 8; attempt++) {
        pthread_mutex_lock(&a->lock);
        chunk_t *s = a->partial[cls];
        if (s) {
            tc_hint(a, s);
            void *p = slab_take(a, s);
            pthread_mutex_unlock(&a->lock);
            return p;
        }
        pthread_mutex_unlock(&a->lock);
        chunk_t *c = new_chunk(a, slab_bytes(block), cls, block);
        if (!c)
            return NULL;
        pthread_mutex_lock(&a->lock);
        a->st.cached_bytes += c->size;
        list_push(&a->partial[cls], c);
        tc_hint(a, c);
        void *p = slab_take(a, c);
        pthread_mutex_unlock(&a->lock);
        return p;
    }
    return NULL;
}

static void *large_alloc(arena_t *a, size_t rsize, int *zero)
{
    size_t want = round_up(rsize, LARGE_GRAIN);
    pthread_mutex_lock(&a->lock);
    chunk_t *best = NULL;
    for (chunk_t *c = a->runs; c; c = c->next)
        if (c->block >= want && c->block <= want + want / 8 &&
            (!best || c->block < best->block))
            best = c;
    if (best) {
        list_unlink(&a->runs, best);
        a->st.cached_bytes -= best->size;
    }
    pthread_mutex_unlock(&a->lock);
    if (!best) {
        best = new_chunk(a, want, -1, want);
        if (!best)
            return NULL;
    }
    pthread_mutex_lock(&a->lock);
    best->in_use = 1;
    best->used = rsize;
    *zero = best->zero;
    best->zero = 0;
    arena_st_alloc(a, best->block);
    pthread_mutex_unlock(&a->lock);
    return (void *)best->base;
}

/* zero: 0 = no, 1 = the first `zero_bytes` must read as zero. */
static void *arena_alloc(arena_t *a, size_t size, size_t zero_bytes)
{
    if (size > SIZE_MAX - LARGE_GRAIN) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t rsize = round_up(size ? size : 1, UMP_ALIGN);
    void *p;
    int fresh = 0;
    if (rsize <= SMALL_MAX)
        p = slab_alloc(a, class_of(rsize));
    else
        p = large_alloc(a, rsize, &fresh);
    if (p && zero_bytes && !fresh)
        memset(p, 0, zero_bytes);
    return p;
}

void *ump_arena_alloc(int id, size_t size)
{
    arena_t *a = arena_get(id);
    if (!a) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    return arena_alloc(a, size, 0);
}

enum free_result { NOT_IN_ARENA, FREED, REFUSED };

/* Free a block if it is an arena's. REFUSED: the pointer is in an arena chunk
 * but not a live block's start (a double or interior free), decided under the
 * registry and arena locks; it is counted and the status set. */
static enum free_result arena_free(void *ptr)
{
    uintptr_t p = (uintptr_t)ptr;
    pthread_rwlock_rdlock(&reg_lock);
    chunk_t *c = reg_find(p);
    if (!c) {
        pthread_rwlock_unlock(&reg_lock);
        return NOT_IN_ARENA;
    }
    arena_t *a = c->arena;
    int bad = 0;
    pthread_mutex_lock(&a->lock);
    if (c->cls >= 0) {
        uintptr_t off = p - c->base;
        uint32_t idx = (uint32_t)(off / c->block);
        uint64_t bit = (uint64_t)1 << (idx % 64);
        /* One atomic step: thread caches clear bits of this word without the
         * lock, and a racing double free through a cache (tc_put) must not
         * also find the bit set. */
        if (off % c->block || !(__atomic_fetch_and(&c->live[idx / 64], ~bit, __ATOMIC_RELAXED) & bit))
            bad = 1;
        else
            slab_put(a, c, idx);
    } else if (p != c->base || !c->in_use) {
        bad = 1;
    } else {
        c->in_use = 0;
        c->used = 0;
        list_push(&a->runs, c);
        a->st.cached_bytes += c->size;
        st_free(&a->st, c->block);
    }
    pthread_mutex_unlock(&a->lock);
    pthread_rwlock_unlock(&reg_lock);
    if (bad) {
        __atomic_fetch_add(&foreign_frees, 1, __ATOMIC_RELAXED);
        ump__set_status(UMP_ERR_ARG);
        return REFUSED;
    }
    return FREED;
}

int ump_arena_free(void *ptr)
{
    if (!ptr)
        return UMP_OK;
    return arena_free(ptr) == FREED ? UMP_OK : ump__set_status(UMP_ERR_ARG);
}

int ump__arena_lookup(uintptr_t p, uintptr_t *base, uint64_t *size, int *arena)
{
    int kind = UMP_KIND_NONE;
    pthread_rwlock_rdlock(&reg_lock);
    chunk_t *c = reg_find(p);
    if (c) {
        uintptr_t b = 0;
        uint64_t s = 0;
        if (c->cls >= 0) {
            uint32_t idx = (uint32_t)((p - c->base) / c->block);
            uint64_t word = __atomic_load_n(&c->live[idx / 64], __ATOMIC_RELAXED);
            if (word & ((uint64_t)1 << (idx % 64))) {
                b = c->base + (uintptr_t)idx * c->block;
                s = c->block;
            }
        } else if (__atomic_load_n(&c->in_use, __ATOMIC_RELAXED) &&
                   p < c->base + c->used) {
            b = c->base;
            s = c->used;
        }
        if (s) {
            kind = c->arena->kind;
            *base = b;
            *size = s;
            *arena = c->arena->id;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
    return kind;
}

/* --- plain aligned fallback ---------------------------------------------
 * Blocks served while no arena is active or the arena is full. They are kept
 * in a hash set so that free() recognises them without reading memory in
 * front of a pointer that may not be ours.
 *
 * A zeroed block of FALLBACK_MAP_MIN bytes or more is fresh anonymous
 * pages (page aligned, so 512-byte aligned): the kernel hands out zero pages
 * and commits memory only where the array is written, as NumPy's own
 * calloc does. posix_memalign + memset would commit all of it at once
 * (np.zeros of 2 GiB: a second and 2 GiB of RSS). */

#define FALLBACK_MAP_MIN ((size_t)64 << 10)

typedef struct { uintptr_t key; size_t size; int mapped; } fb_slot;

static pthread_mutex_t fb_lock = PTHREAD_MUTEX_INITIALIZER;
static fb_slot *fb_tab;
static size_t fb_cap, fb_n;
static ump_stats_t fb_st;

static size_t fb_hash(uintptr_t k, size_t cap)
{
    uint64_t h = (uint64_t)k * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20) & (cap - 1);
}

static int fb_grow(void)
{
    size_t ncap = fb_cap ? fb_cap * 2 : 1024;
    fb_slot *n = calloc(ncap, sizeof *n);
    if (!n)
        return UMP_ERR_NOMEM;
    for (size_t i = 0; i < fb_cap; i++) {
        if (!fb_tab[i].key)
            continue;
        size_t j = fb_hash(fb_tab[i].key, ncap);
        while (n[j].key)
            j = (j + 1) & (ncap - 1);
        n[j] = fb_tab[i];
    }
    free(fb_tab);
    fb_tab = n;
    fb_cap = ncap;
    return UMP_OK;
}

/* Caller holds fb_lock. Index of k, or of the empty slot where it would go. */
static size_t fb_find(uintptr_t k)
{
    size_t i = fb_hash(k, fb_cap);
    while (fb_tab[i].key && fb_tab[i].key != k)
        i = (i + 1) & (fb_cap - 1);
    return i;
}

/* Linear-probing delete with backward shift: no tombstones. */
static void fb_delete_at(size_t i)
{
    size_t j = i;
    for (;;) {
        fb_tab[i].key = 0;
        for (;;) {
            j = (j + 1) & (fb_cap - 1);
            if (!fb_tab[j].key)
                return;
            size_t h = fb_hash(fb_tab[j].key, fb_cap);
            /* can the entry at j move to i? */
            if (i <= j ? (i < h && h <= j) : (i < h || h <= j))
                continue;
            break;
        }
        fb_tab[i] = fb_tab[j];
        i = j;
    }
}

/* rsize bytes, 512-byte aligned; zero-filled if `zero`. */
static void *fb_take(size_t rsize, int zero, int *mapped)
{
    *mapped = zero && rsize >= FALLBACK_MAP_MIN;
    if (*mapped) {
        void *p = mmap(NULL, rsize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    void *p = NULL;
    if (posix_memalign(&p, UMP_ALIGN, rsize) != 0)
        return NULL;
    if (zero)
        memset(p, 0, rsize);
    return p;
}

static void fb_give(void *p, size_t rsize, int mapped)
{
    if (mapped)
        munmap(p, rsize);
    else
        free(p);
}

static void *fallback_alloc(size_t size, int zero)
{
    if (size > SIZE_MAX - UMP_ALIGN) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t rsize = round_up(size ? size : 1, UMP_ALIGN);
    int mapped;
    void *p = fb_take(rsize, zero, &mapped);
    if (!p) {
        ump__set_status(UMP_ERR_NOMEM);
        return NULL;
    }
    pthread_mutex_lock(&fb_lock);
    if ((fb_n + 1) * 2 > fb_cap && fb_grow() != UMP_OK) {
        pthread_mutex_unlock(&fb_lock);
        fb_give(p, rsize, mapped);
        ump__set_status(UMP_ERR_NOMEM);
        return NULL;
    }
    size_t i = fb_find((uintptr_t)p);
    fb_tab[i].key = (uintptr_t)p;
    fb_tab[i].size = rsize;
    fb_tab[i].mapped = mapped;
    fb_n++;
    st_alloc(&fb_st, rsize, 0, 0);
    pthread_mutex_unlock(&fb_lock);
    return p;
}

/* Size of a live fallback block, 0 if p is not one. */
static size_t fallback_owned(void *p)
{
    size_t size = 0;
    pthread_mutex_lock(&fb_lock);
    if (fb_cap) {
        size_t i = fb_find((uintptr_t)p);
        if (fb_tab[i].key)
            size = fb_tab[i].size;
    }
    pthread_mutex_unlock(&fb_lock);
    return size;
}

/* Free p if it is a live fallback block; whether it was one. */
static int fallback_free(void *p)
{
    size_t size = 0;
    int mapped = 0;
    pthread_mutex_lock(&fb_lock);
    if (fb_cap) {
        size_t i = fb_find((uintptr_t)p);
        if (fb_tab[i].key) {
            size = fb_tab[i].size;
            mapped = fb_tab[i].mapped;
            fb_delete_at(i);
            fb_n--;
            st_free(&fb_st, size);
        }
    }
    pthread_mutex_unlock(&fb_lock);
    if (size)
        fb_give(p, size, mapped);
    return size != 0;
}

int ump_fallback_stats(ump_stats_t *out)
{
    if (!out)
        return ump__set_status(UMP_ERR_ARG);
    pthread_mutex_lock(&fb_lock);
    *out = fb_st;
    pthread_mutex_unlock(&fb_lock);
    return UMP_OK;
}

/* --- NEP 49 hooks -------------------------------------------------------- */

int ump_set_numpy_arena(int id)
{
    if (id != -1 && !arena_get(id))
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&numpy_arena, id, __ATOMIC_RELEASE);
    return UMP_OK;
}

int ump_get_numpy_arena(void) { return __atomic_load_n(&numpy_arena, __ATOMIC_ACQUIRE); }

static void *numpy_alloc(size_t size, size_t zero_bytes)
{
    arena_t *a = arena_get(ump_get_numpy_arena());
    if (a && !ump__forked) {
        if (tc.arena != a)
            tc_bind(a);
        if (size <= 4096) {
            void *p = tc_take(a, class_of(size ? (size + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN));
            if (p) {
                if (zero_bytes)
                    memset(p, 0, zero_bytes);
                return p;
            }
        }
        void *p = arena_alloc(a, size, zero_bytes);
        if (p)
            return p;
    }
    /* No arena, or it is full: plain memory, which NumPy uses as usual. */
    return fallback_alloc(size, zero_bytes != 0);
}

void *ump_malloc(size_t size) { return numpy_alloc(size, 0); }

void *ump_calloc(size_t nmemb, size_t size)
{
    if (size && nmemb > SIZE_MAX / size) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t total = nmemb * size;
    return numpy_alloc(total, total ? total : 1);
}

void ump_free(void *ptr, size_t size)
{
    (void)size; /* NumPy's idea of the size; the registry knows the block's */
    if (!ptr)
        return;
    if (tc_put(ptr))
        return;
    if (arena_free(ptr) != NOT_IN_ARENA)
        return;
    if (fallback_free(ptr))
        return;
    /* Not ours: never hand it to a free() that did not allocate it. */
    __atomic_fetch_add(&foreign_frees, 1, __ATOMIC_RELAXED);
}

void *ump_realloc(void *ptr, size_t size)
{
    if (!ptr)
        return ump_malloc(size);
    if (size > SIZE_MAX - LARGE_GRAIN) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t rsize = round_up(size ? size : 1, UMP_ALIGN);
    size_t old = 0;
    int in_place = 0;
    pthread_rwlock_rdlock(&reg_lock);
    chunk_t *c = reg_find((uintptr_t)ptr);
    if (c) {
        pthread_mutex_lock(&c->arena->lock);
        if (c->cls >= 0) {
            uintptr_t off = (uintptr_t)ptr - c->base;
            uint32_t idx = (uint32_t)(off / c->block);
            if (off % c->block == 0 &&
                (__atomic_load_n(&c->live[idx / 64], __ATOMIC_RELAXED) >> (idx % 64)) & 1) {
                old = c->block;
                in_place = rsize <= c->block && class_of(rsize) == c->cls;
            }
        } else if ((uintptr_t)ptr == c->base && c->in_use) {
            old = c->used;
            in_place = rsize <= c->block && rsize > SMALL_MAX &&
                       round_up(rsize, LARGE_GRAIN) + c->block / 8 >= c->block;
            if (in_place)
                c->used = rsize;
        }
        pthread_mutex_unlock(&c->arena->lock);
    }
    pthread_rwlock_unlock(&reg_lock);
    if (!c)
        old = fallback_owned(ptr);
    if (!old) {
        ump__set_status(UMP_ERR_ARG); /* not a live ump block: leave it alone */
        return NULL;
    }
    if (in_place)
        return ptr;
    void *n = ump_malloc(size);
    if (!n)
        return NULL; /* the old block stays valid, as realloc promises */
    memcpy(n, ptr, old < rsize ? old : rsize);
    ump_free(ptr, old);
    return n;
}

/* --- fork ---------------------------------------------------------------
 * A child must not call CUDA; it keeps its inherited blocks usable (freeing
 * them only updates metadata) and serves new NumPy arrays from plain memory.
 * common.c holds these locks across fork() (rank UMP_FORK_ARENAS). */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&tc_list_lock);
    pthread_mutex_lock(&arenas_lock);
    pthread_rwlock_wrlock(&reg_lock);
    for (int i = 0; i < n_arenas; i++)
        pthread_mutex_lock(&arenas[i]->lock);
    pthread_mutex_lock(&fb_lock);
}

static void atfork_release(void)
{
    pthread_mutex_unlock(&fb_lock);
    for (int i = n_arenas - 1; i >= 0; i--)
        pthread_mutex_unlock(&arenas[i]->lock);
    pthread_rwlock_unlock(&reg_lock);
    pthread_mutex_unlock(&arenas_lock);
    pthread_mutex_unlock(&tc_list_lock);
}

static void atfork_child(void)
{
    /* glibc's rwlock remembers the writer's thread id, which differs in the
     * child: unlocking would corrupt it. The child has one thread and no
     * other holder, so fresh locks are exact. */
    pthread_mutex_init(&tc_list_lock, NULL);
    tc_list = NULL;
    if (tc.registered) {
        tc.prev = tc.next = NULL;
        tc_list = &tc;
    }
    pthread_mutex_init(&fb_lock, NULL);
    for (int i = 0; i < n_arenas; i++)
        pthread_mutex_init(&arenas[i]->lock, NULL);
    pthread_rwlock_init(&reg_lock, NULL);
    pthread_mutex_init(&arenas_lock, NULL);
}

__attribute__((constructor)) static void ump_init(void)
{
    pthread_key_create(&tc_key, tc_thread_exit);
    ump__on_fork(UMP_FORK_ARENAS, atfork_prepare, atfork_release, atfork_child);
}
