/*
 * pools.h - the VMM device pools' own parts, which the units of a pool share:
 *
 *   phys.c      physical memory: the driver, or its emulation (phys.h)
 *   handle.c    physical handles: where each is mapped, the cache of unmapped
 *               ones, scavenging, and mapping runs of granules as transactions
 *               with an undo log that grows
 *   block.c     blocks: best fit in per-stream size bins, granule references
 *   region.c    address ranges beyond the main one (buffers, views)
 *   pool.c      pools: ids, the one way in (ump__pool_run), create, destroy,
 *               allocate, free, trim, limits, statistics, devices, lookups, fork
 *   buffer.c    growable buffers
 *   migrate.c   moving physical memory to another device under its addresses
 *   view.c      views: shared, imported, alias, ring, striped
 *
 * Each unit calls only those listed above it. Not part of the public API.
 */
#ifndef UMP_POOLS_H
#define UMP_POOLS_H

#include "phys.h"

#include <pthread.h>

#define NBINS 128 /* 4 bins per power of two of 512-byte units */
/* Streams whose free blocks a pool keeps apart. A stream's bins go when its
 * last free block leaves them; when this many streams hold free blocks and
 * another frees one, the pool waits for its devices and hands every free
 * block to that stream (ump__merge_streams), so a program that cycles through
 * many streams costs a wait every MAX_STREAM_BINS new ones, not a lookup
 * that grows with every stream it ever used. */
#define MAX_STREAM_BINS 64
#define MAP_AHEAD 16 /* granules of cached handles mapped behind a run */

typedef struct blk {
    uint64_t off, size;           /* within the main range, 512-byte units */
    struct blk *prev, *next;      /* address order, every block below top */
    struct blk *fprev, *fnext;    /* free bin */
    uintptr_t stream;
    int bin;                      /* -1 while handed out */
} blk_t;

typedef struct {
    uintptr_t stream;
    uint64_t nfree;    /* blocks in its bins; at 0 the entry is given back */
    blk_t *bin[NBINS];
} sbins_t;

typedef struct {
    uint64_t h;        /* CUmemGenericAllocationHandle, or a memfd */
    uint64_t ngran;
    int device;
    int region;        /* -1: cached (unmapped); 0: main range; b+1: region b */
    uint64_t at;       /* first granule where mapped */
    uint64_t busy;     /* main range: its granules that live blocks touch */
    int view;          /* v+1: owned by view v, released with it; 0: the pool's */
    int imported;      /* another process's memory: not counted as the pool's */
    int pins;          /* aliases mapping it too: it must stay where it is */
} handle_t;

/* What a region is: the main range, a buffer, or a view (UMP_VIEW_*). */
enum { REGION_MAIN, REGION_BUFFER };

typedef struct {
    uintptr_t va;
    uint64_t ngran;
    int64_t *gh;       /* per granule: index of the handle mapped there, or -1 */
    uint64_t size;     /* buffers: bytes in use; views: bytes mapped */
    int live;
    int kind;          /* REGION_*, UMP_VIEW_* */
    ump_vmm_view_times_t times; /* views: how long making it took */
} region_t;

typedef struct {
    int used;
    int closing;       /* destroyed: its memory is gone, its slot still pinned */
    int users;         /* pins: calls between resolving its id and letting go */
    ump__phys_t ph;    /* its physical layer: provider, device, access list */
    pthread_mutex_t lock;
    region_t main;
    uint32_t *gref;    /* per granule of the main range: live blocks touching it */
    uint64_t top;      /* bytes of the main range carved into blocks */
    blk_t *last;       /* the block ending at top */
    sbins_t *sb;       /* MAX_STREAM_BINS entries, nsb of them in use */
    int nsb;
    blk_t **live;      /* handed-out blocks, sorted by offset */
    size_t nlive, caplive;
    handle_t *hs;
    size_t nh, caph;
    region_t *bufs;    /* buffers and views */
    int nbufs;
    ump_vmm_stats_t st; /* st.limit_bytes is the limit (0: none) */
} pool_t;

static inline region_t *region_of(pool_t *p, int region)
{
    return region == 0 ? &p->main : &p->bufs[region - 1];
}

static inline uint64_t granules(const pool_t *p, uint64_t bytes)
{
    return (bytes + p->ph.gran - 1) / p->ph.gran;
}

/* --- handle.c -------------------------------------------------------------- */

/* Record a handle. `view`: v+1 for a handle view v owns; `imported`: the
 * memory is another process's, so it is not counted as the pool's. -1 if
 * there is no memory to record it. */
UMP_HIDDEN int64_t ump__handle_new(pool_t *p, uint64_t h, uint64_t ngran, int device, int view,
                                   int imported);
/* Release a handle and forget it. */
UMP_HIDDEN void ump__handle_drop(pool_t *p, int64_t i);
/* Unmap a handle; it stays held, in the cache. The caller synchronised. */
UMP_HIDDEN int ump__handle_unmap(pool_t *p, int64_t i);
/* Unmap every handle of the main range that no live block touches. */
UMP_HIDDEN uint64_t ump__scavenge(pool_t *p);
/* Release cached handles (all of them, or those larger than `keep_below`
 * granules, which could not fill the run being mapped). */
UMP_HIDDEN uint64_t ump__release_cached(pool_t *p, uint64_t keep_below);
/* Back granules [g0, g0+k) of a region, all unmapped, with handles and
 * grant access to them, as one transaction. */
UMP_HIDDEN int ump__map_run(pool_t *p, int region, uint64_t g0, uint64_t k);

/* --- block.c --------------------------------------------------------------- */

/* Hand out a block of `size` bytes freed on (or new to) `stream`. */
UMP_HIDDEN int ump__block_alloc(pool_t *p, uint64_t size, uintptr_t stream, uintptr_t *ptr);
/* Take back the live block at ptr; UMP_ERR_ARG if there is none. */
UMP_HIDDEN int ump__block_free(pool_t *p, uintptr_t ptr);
/* The live block that starts last at or below main-range offset `off`
 * (it may end before it), or NULL. */
UMP_HIDDEN blk_t *ump__block_below(pool_t *p, uint64_t off);
/* Free every block and the bins (the pool is going). */
UMP_HIDDEN void ump__blocks_destroy(pool_t *p);

/* --- region.c -------------------------------------------------------------- */

/* A region slot of `kind` with a reservation of `ngran` granules, nothing
 * mapped. */
UMP_HIDDEN int ump__region_open(pool_t *p, int kind, uint64_t ngran, int *idx);
/* Unreserve and forget region `idx`, whose mappings the caller took down. */
UMP_HIDDEN void ump__region_close(pool_t *p, int idx);
/* The region holding ptr (its index through *region: 0 for the main
 * range, b+1 for region b), or NULL. */
UMP_HIDDEN region_t *ump__region_at(pool_t *p, uintptr_t ptr, int *region);
/* Unmap the handles of a region that lie wholly at or past granule `from`;
 * the caller synchronised. */
UMP_HIDDEN void ump__unmap_from(pool_t *p, int region, uint64_t from);
/* Apply the pool's access list to every mapped run of a region. */
UMP_HIDDEN int ump__grant_region(pool_t *p, region_t *r);

/* --- pool.c ---------------------------------------------------------------- */

/* The one way into a pool: pin pool `id`, take its lock, run op(p, arg),
 * let go; the status, kept for ump_last_status() if it is a failure.
 * UMP_ERR_ARG for an id no pool can have, UMP_ERR_HANDLE for one that
 * names no open pool (never did, or destroyed). */
typedef int (*ump__pool_op)(pool_t *p, void *arg);
UMP_HIDDEN int ump__pool_run(int id, ump__pool_op op, void *arg);

/* A buffer's or view's address, size and (times not NULL) set-up times,
 * from region `idx` if get() finds it one of its sort. */
typedef region_t *(*ump__region_get)(pool_t *p, int idx);
UMP_HIDDEN int ump__region_info(int id, ump__region_get get, int idx, uintptr_t *ptr,
                                uint64_t *size, int *kind, ump_vmm_view_times_t *times);

#endif
