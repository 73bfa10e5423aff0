/*
 * tcache.c - the per-thread cache of small blocks.
 *
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
 * folds into the arena's.
 */
#include "arenas.h"

#include <string.h>


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

/* The caller holds a's lock, so s cannot leave the registry before the
 * generation is read. */
void ump__tc_hint(arena_t *a, chunk_t *s)
{
    if (tc.arena != a || s->cls >= TC_CLASSES)
        return;
    uint64_t gen = ump__reg_gen();
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

void *ump__tc_alloc(arena_t *a, size_t size)
{
    if (tc.arena != a)
        tc_bind(a);
    if (size > 4096)
        return NULL;
    return tc_take(a, class_of(size ? round_up(size, UMP_ALIGN) : UMP_ALIGN));
}

/* The locked path a 0 sends the free down also reports double and interior
 * frees. */
int ump__tc_put(void *ptr)
{
    if (!tc.arena || tc.gen != ump__reg_gen())
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

/* The peak leaves out blocks in thread caches (free for users, yet in
 * st.current) as their threads last told the arena, here: it cannot sum the
 * caches itself without tc_list_lock, which ranks before the arena lock. So
 * other threads' caches count as of their last allocation under the lock,
 * and a high reached through caches alone is recorded when statistics are
 * read. */
void ump__tc_count_alloc(arena_t *a, size_t bytes)
{
    if (tc.arena == a) {
        a->tc_bytes += tc.bytes - tc.pub_bytes;
        a->tc_count += tc.count - tc.pub_count;
        tc.pub_bytes = tc.bytes;
        tc.pub_count = tc.count;
    }
    st_alloc(&a->st, bytes, a->tc_bytes, a->tc_count);
}

void ump__tc_flush_if(arena_t *a)
{
    if (tc.arena == a)
        tc_flush();
}

void ump__tc_stats(arena_t *a, ump_stats_t *out)
{
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
}

/* --- fork: the list's lock is held across fork() (rank UMP_FORK_TCACHE) ---- */

static void fork_prepare(void) { pthread_mutex_lock(&tc_list_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&tc_list_lock); }

/* The child's one thread is the one that forked: only its cache is left. */
static void fork_child(void)
{
    pthread_mutex_init(&tc_list_lock, NULL);
    tc_list = NULL;
    if (tc.registered) {
        tc.prev = tc.next = NULL;
        tc_list = &tc;
    }
}

__attribute__((constructor)) static void tcache_init(void)
{
    pthread_key_create(&tc_key, tc_thread_exit);
    ump__on_fork(UMP_FORK_TCACHE, fork_prepare, fork_parent, fork_child);
}
