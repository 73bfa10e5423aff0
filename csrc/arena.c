/*
 * arena.c - size-class arenas over large chunks.
 *
 * Requests up to 1 MiB are served from slabs: a chunk of one size class cut
 * into equal slots (512-byte multiples, at most 12.5 % internal waste).
 * Larger requests get a run of their own (64 KiB grain); freed runs are
 * cached and reused for requests within 12.5 % of their size. Empty slabs
 * and cached runs go back to the provider on ump_arena_trim() or when the
 * cap would otherwise be exceeded.
 *
 * Locks: a thread cache's flush (tcache.c) or the registry, then an arena's
 * mutex. The allocation path takes only the arena mutex (or, through a thread
 * cache, none); provider calls are made with no lock held.
 */
#include "arenas.h"

#include <stdlib.h>

/* One budget per kind and device: the NumPy-side and CuPy-side arenas of a
 * backend share its cap, so the cap bounds all the memory the backend holds
 * there. Entries are never removed (arenas live as long as the process). */
static budget_t budgets[UMP_MAX_ARENAS];
static int budget_count;

arena_t *ump__arenas[UMP_MAX_ARENAS];
static int n_arenas;
static pthread_mutex_t arenas_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t slab_bytes(size_t block)
{
    size_t want = block * SLAB_MIN_SLOTS;
    return want < SLAB_MIN ? SLAB_MIN : round_up(want, SLAB_MIN);
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
        arena_t *a = ump__arenas[i];
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
    __atomic_store_n(&ump__arenas[n_arenas], a, __ATOMIC_RELEASE);
    *id = n_arenas++;
    pthread_mutex_unlock(&arenas_lock);
    return UMP_OK;
}

int ump_arena_set_cap(int id, uint64_t cap_bytes)
{
    arena_t *a = ump__arena_get(id);
    if (!a)
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&a->budget->cap, cap_bytes, __ATOMIC_RELAXED);
    return UMP_OK;
}

int ump_arena_stats(int id, ump_stats_t *out)
{
    arena_t *a = ump__arena_get(id);
    if (!a || !out)
        return ump__set_status(UMP_ERR_ARG);
    ump__tc_flush_if(a);
    ump__tc_stats(a, out);
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
    arena_t *a = ump__arena_get(id);
    if (!a)
        return ump__set_status(UMP_ERR_ARG);
    chunk_t *victims = NULL;
    ump__tc_flush_if(a);
    ump__reg_write();
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
        ump__reg_remove(c);
        __atomic_fetch_sub(&a->budget->held, c->size, __ATOMIC_RELAXED);
        a->st.held_bytes -= c->size;
        a->st.cached_bytes -= c->size;
        a->st.chunk_frees++;
    }
    pthread_mutex_unlock(&a->lock);
    ump__reg_done();
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
            arena_t *other = ump__arena_get(i);
            if (other && other->budget == b)
                cached += cached_of(other);
        }
        if (cached < need)
            break;
        for (int i = 0; i < UMP_MAX_ARENAS; i++) {
            arena_t *other = ump__arena_get(i);
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
    ump__reg_write();
    status = ump__reg_insert(c);
    ump__reg_done();
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

/* Caller holds the arena lock; s has a free slot. */
static void *slab_take(arena_t *a, chunk_t *s)
{
    uint32_t idx = s->free_stack[--s->nfree];
    __atomic_fetch_or(&s->live[idx / 64], (uint64_t)1 << (idx % 64), __ATOMIC_RELAXED);
    if (s->nfree == s->nslots - 1)
        a->st.cached_bytes -= s->size; /* was wholly free */
    if (s->nfree == 0)
        list_unlink(&a->partial[s->cls], s);
    ump__tc_count_alloc(a, s->block);
    return (void *)(s->base + (uintptr_t)idx * s->block);
}

static void *slab_alloc(arena_t *a, int cls)
{
    size_t block = class_size(cls);
    pthread_mutex_lock(&a->lock);
    chunk_t *s = a->partial[cls];
    if (s) {
        ump__tc_hint(a, s);
        void *p = slab_take(a, s);
        pthread_mutex_unlock(&a->lock);
        return p;
    }
    pthread_mutex_unlock(&a->lock);
    /* No lock while the provider works; another thread may meanwhile make a
     * slab of this class too, and both serve. */
    chunk_t *c = new_chunk(a, slab_bytes(block), cls, block);
    if (!c)
        return NULL;
    pthread_mutex_lock(&a->lock);
    a->st.cached_bytes += c->size;
    list_push(&a->partial[cls], c);
    ump__tc_hint(a, c);
    void *p = slab_take(a, c);
    pthread_mutex_unlock(&a->lock);
    return p;
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
    ump__tc_count_alloc(a, best->block);
    pthread_mutex_unlock(&a->lock);
    return (void *)best->base;
}

void *ump__arena_alloc(arena_t *a, size_t size, size_t zero_bytes)
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
        ump__provider_zero(a->provider, p, zero_bytes);
    return p;
}

void *ump_arena_alloc(int id, size_t size)
{
    arena_t *a = ump__arena_get(id);
    if (!a) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    return ump__arena_alloc(a, size, 0);
}

/* Decided under the registry and arena locks. */
enum ump__free_result ump__arena_free(void *ptr)
{
    uintptr_t p = (uintptr_t)ptr;
    ump__reg_read();
    chunk_t *c = ump__reg_find(p);
    if (!c) {
        ump__reg_done();
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
    ump__reg_done();
    if (bad) {
        ump__foreign_free();
        ump__set_status(UMP_ERR_ARG);
        return REFUSED;
    }
    return FREED;
}

int ump_arena_free(void *ptr)
{
    if (!ptr)
        return UMP_OK;
    return ump__arena_free(ptr) == FREED ? UMP_OK : ump__set_status(UMP_ERR_ARG);
}

size_t ump__arena_resize(void *ptr, size_t rsize, int *in_place)
{
    size_t old = 0;
    *in_place = 0;
    ump__reg_read();
    chunk_t *c = ump__reg_find((uintptr_t)ptr);
    if (c) {
        pthread_mutex_lock(&c->arena->lock);
        if (c->cls >= 0) {
            uintptr_t off = (uintptr_t)ptr - c->base;
            uint32_t idx = (uint32_t)(off / c->block);
            if (off % c->block == 0 &&
                (__atomic_load_n(&c->live[idx / 64], __ATOMIC_RELAXED) >> (idx % 64)) & 1) {
                old = c->block;
                *in_place = rsize <= c->block && class_of(rsize) == c->cls;
            }
        } else if ((uintptr_t)ptr == c->base && c->in_use) {
            old = c->used;
            *in_place = rsize <= c->block && rsize > SMALL_MAX &&
                        round_up(rsize, LARGE_GRAIN) + c->block / 8 >= c->block;
            if (*in_place)
                c->used = rsize;
        }
        pthread_mutex_unlock(&c->arena->lock);
    }
    ump__reg_done();
    return old;
}

/* --- fork: held across fork() (rank UMP_FORK_ARENAS) ---------------------- */

static void fork_prepare(void)
{
    pthread_mutex_lock(&arenas_lock);
    for (int i = 0; i < n_arenas; i++)
        pthread_mutex_lock(&ump__arenas[i]->lock);
}

static void fork_parent(void)
{
    for (int i = n_arenas - 1; i >= 0; i--)
        pthread_mutex_unlock(&ump__arenas[i]->lock);
    pthread_mutex_unlock(&arenas_lock);
}

/* A child must not call CUDA; it keeps its inherited blocks usable (freeing
 * them only updates metadata) and serves new NumPy arrays from plain memory.
 * Its one thread holds no lock, so fresh ones are exact. */
static void fork_child(void)
{
    for (int i = 0; i < n_arenas; i++)
        pthread_mutex_init(&ump__arenas[i]->lock, NULL);
    pthread_mutex_init(&arenas_lock, NULL);
}

__attribute__((constructor)) static void arenas_init(void)
{
    ump__on_fork(UMP_FORK_ARENAS, fork_prepare, fork_parent, fork_child);
}
