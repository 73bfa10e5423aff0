/*
 * arenas.h - the size-class arenas' own parts, which their units share:
 *
 *   registry.c  the sorted chunk registry: which chunk holds a pointer
 *   tcache.c    the per-thread cache of small NumPy blocks
 *   arena.c     arenas: budgets, chunks from the providers, slabs, large runs,
 *               trim, statistics
 *   fallback.c  plain aligned memory while no arena serves (or it is full)
 *   hooks.c     the NEP 49 hooks NumPy calls
 *
 * Each unit calls only those listed above it. Metadata never lives inside
 * blocks: a managed chunk written by the CPU would migrate to the host, and
 * device memory cannot be written at all. Not part of the public API.
 */
#ifndef UMP_ARENAS_H
#define UMP_ARENAS_H

#include "internal.h"

#include <pthread.h>

#define N_CLASSES 72
#define SMALL_MAX ((size_t)1 << 20)
#define LARGE_GRAIN ((size_t)64 << 10)
#define SLAB_MIN ((size_t)UMP_CHUNK_MIN)
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
    uint64_t tc_bytes, tc_count; /* in thread caches, as their threads last told (tcache.c) */
};

static inline size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

/* --- size classes: 512, 1024, ..., 4096, then eight steps per power of two
 * up to 1 MiB, so a block wastes at most 12.5 % of itself. */

static inline int class_of(size_t rsize)
{
    if (rsize <= 4096)
        return (int)(rsize / UMP_ALIGN) - 1;
    int p = 63 - __builtin_clzll((unsigned long long)(rsize - 1));
    size_t step = (size_t)1 << (p - 3);
    size_t j = (rsize - ((size_t)1 << p) + step - 1) / step;
    return 8 + (p - 12) * 8 + (int)j - 1;
}

static inline size_t class_size(int cls)
{
    if (cls < 8)
        return (size_t)(cls + 1) * UMP_ALIGN;
    int p = 12 + (cls - 8) / 8;
    size_t j = (size_t)((cls - 8) % 8) + 1;
    return ((size_t)1 << p) + j * ((size_t)1 << (p - 3));
}

/* --- statistics (the caller holds the lock of what they count) ------------- */

static inline uint64_t sat_sub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }

static inline void st_peak(ump_stats_t *st, uint64_t bytes, uint64_t count)
{
    if (bytes > st->peak_bytes)
        st->peak_bytes = bytes;
    if (count > st->peak_count)
        st->peak_count = count;
}

/* Count a block handed out. The peak leaves out `idle_*`: blocks counted in
 * current_* that are free for users (in thread caches). */
static inline void st_alloc(ump_stats_t *st, size_t bytes, uint64_t idle_bytes, uint64_t idle_count)
{
    st->current_bytes += bytes;
    st->total_bytes += bytes;
    st->current_count++;
    st->total_count++;
    st_peak(st, sat_sub(st->current_bytes, idle_bytes), sat_sub(st->current_count, idle_count));
}

static inline void st_free(ump_stats_t *st, size_t bytes)
{
    st->current_bytes -= bytes;
    st->current_count--;
}

/* --- chunk lists ------------------------------------------------------------ */

static inline void list_push(chunk_t **head, chunk_t *c)
{
    c->prev = NULL;
    c->next = *head;
    if (*head)
        (*head)->prev = c;
    *head = c;
}

static inline void list_unlink(chunk_t **head, chunk_t *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        *head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next = c->prev = NULL;
}

/* Give slot idx back to slab c. The caller holds the arena lock and has
 * cleared the slot's live bit (or it was cleared when a thread cache took it). */
static inline void slab_put(arena_t *a, chunk_t *c, uint32_t idx)
{
    c->free_stack[c->nfree++] = idx;
    if (c->nfree == 1)
        list_push(&a->partial[c->cls], c);
    if (c->nfree == c->nslots)
        a->st.cached_bytes += c->size; /* wholly free: trim may take it */
    st_free(&a->st, c->block);
}

/* --- registry.c ------------------------------------------------------------- */

UMP_HIDDEN void ump__reg_read(void);
UMP_HIDDEN void ump__reg_write(void);
UMP_HIDDEN void ump__reg_done(void);
/* The chunk holding p, or NULL; under the registry's lock. */
UMP_HIDDEN chunk_t *ump__reg_find(uintptr_t p);
/* Under the registry's lock for writing. */
UMP_HIDDEN int ump__reg_insert(chunk_t *c);
UMP_HIDDEN void ump__reg_remove(chunk_t *c);
/* Moves on, under the registry's lock, whenever a chunk leaves; read on
 * every free, hence inline. */
UMP_HIDDEN extern uint64_t ump__reg_generation;
static inline uint64_t ump__reg_gen(void) { return __atomic_load_n(&ump__reg_generation, __ATOMIC_ACQUIRE); }
/* Count a free of a pointer that is no live block of ump's. */
UMP_HIDDEN void ump__foreign_free(void);

/* --- tcache.c --------------------------------------------------------------- */

/* A block of `size` bytes from this thread's cache, bound to arena a first
 * (the hooks' arena; blocks of another go back to their slabs), or NULL. */
UMP_HIDDEN void *ump__tc_alloc(arena_t *a, size_t size);
/* Cache a freed block if it is in one of this thread's hinted slabs: 1 if
 * cached; 0 sends the free down the locked path. */
UMP_HIDDEN int ump__tc_put(void *ptr);
/* Remember that class cls of arena a served from slab s (a's lock held). */
UMP_HIDDEN void ump__tc_hint(arena_t *a, chunk_t *s);
/* Count a block of arena a handed out (a's lock held), leaving the blocks in
 * this thread's cache out of the peak. */
UMP_HIDDEN void ump__tc_count_alloc(arena_t *a, size_t bytes);
/* Return this thread's cached blocks to their slabs, if they are a's. */
UMP_HIDDEN void ump__tc_flush_if(arena_t *a);
/* Arena a's statistics with the blocks in thread caches counted as free
 * and those handed out from them as allocated. */
UMP_HIDDEN void ump__tc_stats(arena_t *a, ump_stats_t *out);

/* --- arena.c ---------------------------------------------------------------- */

/* Arena `id`, or NULL; read on every allocation, hence inline. */
UMP_HIDDEN extern arena_t *ump__arenas[UMP_MAX_ARENAS];
static inline arena_t *ump__arena_get(int id)
{
    if (id < 0 || id >= UMP_MAX_ARENAS)
        return NULL;
    return __atomic_load_n(&ump__arenas[id], __ATOMIC_ACQUIRE);
}
/* A block of `size` bytes, the first `zero_bytes` of it zeroed; NULL with the
 * status set. */
UMP_HIDDEN void *ump__arena_alloc(arena_t *a, size_t size, size_t zero_bytes);
enum ump__free_result { NOT_IN_ARENA, FREED, REFUSED };
/* Free a block if it is an arena's. REFUSED: in an arena chunk but not a live
 * block's start (a double or interior free), counted and the status set. */
UMP_HIDDEN enum ump__free_result ump__arena_free(void *ptr);
/* The capacity of the live arena block at ptr (0 if none), and whether a
 * request of rsize bytes fits it in place (a large run's size then becomes
 * rsize). */
UMP_HIDDEN size_t ump__arena_resize(void *ptr, size_t rsize, int *in_place);

/* --- fallback.c ------------------------------------------------------------- */

UMP_HIDDEN void *ump__fallback_alloc(size_t size, int zero);
/* Free p if it is a live fallback block; whether it was one. */
UMP_HIDDEN int ump__fallback_free(void *p);
/* The size of a live fallback block, 0 if p is not one. */
UMP_HIDDEN size_t ump__fallback_owned(void *p);

#endif
