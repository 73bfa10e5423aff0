/*
 * vmm.c - device pools on CUDA's virtual memory management API.
 *
 * A pool reserves one large address range (cuMemAddressReserve) and cuts it
 * into blocks with a best-fit allocator: free blocks sit in size bins, one
 * set of bins per CUDA stream, and neighbours freed on the same stream merge.
 * Physical memory is a separate layer. The range is divided into granules
 * (2 MiB on current GPUs); a granule is backed by a physical handle
 * (cuMemCreate) only while some block needs it, and a handle may span many
 * granules, so a large request maps few, large handles.
 *
 * Why physical and virtual are kept apart: a hole between live blocks costs
 * address space only. When new memory must be mapped, handles come first
 * from the cache of unmapped handles, then from mapped handles that no live
 * block touches (they are unmapped and moved: "scavenged"), and only then
 * from cuMemCreate. So the pool holds about what its live blocks touch, not
 * what its address range has ever spanned.
 *
 * Costs measured on an H200 per 2 MiB: create 12 us, map 2 us, set-access
 * 40 us, unmap 25 us, release 13 us. Handles are therefore reused rather than
 * released, access is granted once per mapped run, not per handle, and a run
 * mapped from the cache takes a few more cached handles behind it under the
 * same set-access.
 *
 * Stream order: a block freed on stream S goes to S's bins and is handed out
 * again only on S, where later work is ordered after the kernels that used
 * it. Unmapping is a host-side operation, so every unmap (scavenge, trim,
 * migration, buffer shrink) first waits for the device.
 *
 * The same code runs without a GPU on an emulated physical layer: a handle is
 * a memfd, mapping is mmap(MAP_FIXED|MAP_SHARED) into a PROT_NONE
 * reservation. Tests on machines without a GPU exercise the allocator, the
 * granule bookkeeping, handle reuse, trim, transactions and migration through
 * it.
 *
 * Every pool has one mutex; all operations, CUDA calls included, run under
 * it, which makes each multi-step mapping a transaction other threads never
 * see half-done.
 *
 * Views (the end of this file) give physical memory a second address range:
 * memory shared with other processes (exported as a file descriptor,
 * imported there), an alias of a block, a ring buffer mapped twice back to
 * back, memory striped over devices.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NBINS 128      /* 4 bins per power of two of 512-byte units */
/* Streams whose free blocks a pool keeps apart. A stream's bins go when its
 * last free block leaves them; when this many streams hold free blocks and
 * another frees one, the pool waits for its devices and hands every free
 * block to that stream (merge_streams), so a program that cycles through
 * many streams costs a wait every MAX_STREAM_BINS new ones, not a lookup
 * that grows with every stream it ever used. */
#define MAX_STREAM_BINS 64
#define MAX_DEVICES 16 /* devices a pool may grant access to */
#define MAP_AHEAD 16   /* granules of cached handles mapped behind a run */

/* --- data structures ----------------------------------------------------- */

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

/* What a region beyond the main range is. */
enum { REGION_MAIN, REGION_BUFFER, REGION_SHARED, REGION_IMPORTED, REGION_ALIAS, REGION_RING,
       REGION_STRIPED };

typedef struct {
    uintptr_t va;
    uint64_t ngran;
    int64_t *gh;       /* per granule: index of the handle mapped there, or -1 */
    uint64_t size;     /* buffers: bytes in use; views: bytes mapped */
    int live;
    int kind;          /* REGION_* */
    ump_vmm_view_times_t times; /* views: how long making it took */
} region_t;

typedef struct {
    int used, provider, device;
    int closing;       /* destroyed: its memory is gone, its slot still pinned */
    int inherited;     /* a forked child's copy: its handles are the parent's too */
    int users;         /* pins: calls between resolving its id and letting go */
    void *ctx;
    uint64_t gran;
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
    int ndev;
    int devs[MAX_DEVICES];
    ump_vmm_stats_t st; /* st.limit_bytes is the limit (0: none) */
} pool_t;

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

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* --- the physical layer: CUDA, or memfd + mmap emulating it --------------- */

static int ph_enter(pool_t *p, int *pushed)
{
    *pushed = 0;
    /* A child's copy of an emulated pool maps the parent's memfds
     * (MAP_SHARED): anything it mapped or moved would be the parent's
     * memory. Pools the child makes itself are its own. */
    if (p->provider == UMP_PROVIDER_HOST)
        return p->inherited ? UMP_ERR_FORKED : UMP_OK;
    int status = ump__cuda_ready();
    if (status == UMP_OK)
        *pushed = ump__ctx_enter(p->ctx);
    return status;
}

static void ph_leave(pool_t *p, int pushed)
{
    if (p->provider != UMP_PROVIDER_HOST)
        ump__ctx_leave(pushed);
}

static CUmemAllocationProp prop_for(int device, int exportable)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

/* The emulation's exportable memory: a memfd of this name whose size is
 * sealed, so no process holding it can shrink it under another's mapping
 * (which would turn that process's reads into SIGBUS). An importer checks
 * both, which tells a handle of ump's from any other file descriptor. */
#define SHARE_NAME "ump-vmm-shared"
#define SHARE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

static int ph_create(pool_t *p, uint64_t bytes, int device, int exportable, uint64_t *out)
{
    int status = ump__injected_failure();
    if (status != UMP_OK)
        return status;
    if (p->provider == UMP_PROVIDER_HOST) {
        /* Out of descriptors (EMFILE) is not out of memory: say which. */
        int fd = exportable ? memfd_create(SHARE_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING)
                            : memfd_create("ump-vmm", MFD_CLOEXEC);
        if (fd < 0)
            return ump__os_status(errno);
        if (ftruncate(fd, (off_t)bytes) != 0 ||
            (exportable && fcntl(fd, F_ADD_SEALS, SHARE_SEALS) != 0)) {
            status = ump__os_status(errno);
            close(fd);
            return status;
        }
        *out = (uint64_t)fd;
        return UMP_OK;
    }
    CUmemAllocationProp prop = prop_for(device, exportable);
    CUmemGenericAllocationHandle h = 0;
    status = ump__cu.memCreate(&h, bytes, &prop, 0);
    *out = h;
    return status;
}

/* A new file descriptor for an exportable handle; the caller owns it. */
static int ph_export(pool_t *p, uint64_t h, int *fd)
{
    *fd = -1;
    if (p->provider == UMP_PROVIDER_HOST) {
        *fd = fcntl((int)h, F_DUPFD_CLOEXEC, 0);
        return *fd < 0 ? ump__os_status(errno) : UMP_OK;
    }
    return ump__cu.memExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

/* A handle of our own for the physical memory behind another process's
 * exported fd (which stays the caller's). `bytes`: the size the exporter
 * described; `*device` is set to where the memory lives. */
static int ph_import(pool_t *p, int fd, uint64_t bytes, uint64_t *h, int *device)
{
    if (fcntl(fd, F_GETFD) < 0)
        return UMP_ERR_HANDLE; /* closed */
    if (p->provider == UMP_PROVIDER_HOST) {
        char link[32], name[64];
        struct stat st;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, name, sizeof name - 1);
        name[n > 0 ? n : 0] = 0;
        if (strncmp(name, "/memfd:" SHARE_NAME, strlen("/memfd:" SHARE_NAME)) != 0 ||
            fcntl(fd, F_GET_SEALS) != SHARE_SEALS || fstat(fd, &st) != 0 ||
            (uint64_t)st.st_size != bytes)
            return UMP_ERR_HANDLE;
        int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (own < 0)
            return ump__os_status(errno);
        *h = (uint64_t)own;
        return UMP_OK;
    }
    /* The driver cannot tell the size before mapping: a handle smaller than
     * described fails at cuMemMap. */
    CUmemGenericAllocationHandle ch = 0;
    int status = ump__cu.memImportFromShareableHandle(&ch, (void *)(uintptr_t)fd,
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (status != CUDA_SUCCESS)
        return status;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    status = ump__cu.memGetAllocationPropertiesFromHandle(&prop, ch);
    if (status == CUDA_SUCCESS && (prop.type != CU_MEM_ALLOCATION_TYPE_PINNED ||
                                   prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
                                   prop.location.id < 0))
        status = UMP_ERR_HANDLE; /* not device memory cuMemCreate made */
    if (status != CUDA_SUCCESS) {
        ump__cu.memRelease(ch);
        return status;
    }
    *h = ch;
    *device = prop.location.id;
    return UMP_OK;
}

static void ph_release(pool_t *p, uint64_t h)
{
    if (p->provider == UMP_PROVIDER_HOST)
        close((int)h);
    else
        ump__cu.memRelease(h);
}

static int ph_map_raw(pool_t *p, uintptr_t va, uint64_t bytes, uint64_t h)
{
    if (p->provider == UMP_PROVIDER_HOST) {
        void *m = mmap((void *)va, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)h, 0);
        return m == MAP_FAILED ? ump__os_status(errno) : UMP_OK;
    }
    return ump__cu.memMap(va, bytes, 0, h, 0);
}

static int ph_map(pool_t *p, uintptr_t va, uint64_t bytes, uint64_t h)
{
    int status = ump__injected_failure();
    return status != UMP_OK ? status : ph_map_raw(p, va, bytes, h);
}

static int ph_unmap(pool_t *p, uintptr_t va, uint64_t bytes)
{
    if (p->provider == UMP_PROVIDER_HOST) {
        /* Back to an inaccessible reservation, as cuMemUnmap leaves it. */
        void *m = mmap((void *)va, bytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        return m == MAP_FAILED ? UMP_ERR_NOMEM : UMP_OK;
    }
    return ump__cu.memUnmap(va, bytes);
}

/* Every mapping starts inaccessible: grant each device of the pool access. */
static int ph_access(pool_t *p, uintptr_t va, uint64_t bytes)
{
    if (p->provider == UMP_PROVIDER_HOST)
        return UMP_OK;
    CUmemAccessDesc desc[MAX_DEVICES];
    for (int i = 0; i < p->ndev; i++) {
        desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        desc[i].location.id = p->devs[i];
        desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return ump__cu.memSetAccess(va, bytes, desc, (size_t)p->ndev);
}

/* Wait for the work of `device`'s primary context (the runtime's, CuPy's).
 * One that is not active has no kernel left that could use the pool. */
static int sync_device(int device)
{
    if (!ump__cu.deviceGet || !ump__cu.primaryCtxGetState || !ump__cu.primaryCtxRetain ||
        !ump__cu.primaryCtxRelease)
        return UMP_ERR_NOCUDA;
    CUdevice dev;
    int active = 0;
    unsigned flags;
    CUcontext ctx, popped;
    int status = ump__cu.deviceGet(&dev, device);
    if (status == CUDA_SUCCESS)
        status = ump__cu.primaryCtxGetState(dev, &flags, &active);
    if (status != CUDA_SUCCESS || !active)
        return status;
    status = ump__cu.primaryCtxRetain(&ctx, dev);
    if (status != CUDA_SUCCESS)
        return status;
    status = ump__cu.ctxPushCurrent(ctx);
    if (status == CUDA_SUCCESS) {
        status = ump__cu.ctxSynchronize();
        ump__cu.ctxPopCurrent(&popped);
    }
    ump__cu.primaryCtxRelease(dev);
    return status;
}

/* Before anything is unmapped: kernels on every device granted access may
 * still read the pages, not only those of the pool's own device. */
static int ph_sync(pool_t *p)
{
    int pushed, status = ph_enter(p, &pushed);
    if (status == UMP_OK && p->provider != UMP_PROVIDER_HOST) {
        status = ump__cu.ctxSynchronize();
        for (int d = 1; d < p->ndev && status == UMP_OK; d++) /* devs[0] is the pool's */
            status = sync_device(p->devs[d]);
    }
    ph_leave(p, pushed);
    return status;
}

static int ph_reserve(pool_t *p, uint64_t bytes, uintptr_t *va)
{
    if (p->provider == UMP_PROVIDER_HOST) {
        void *m = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        *va = m == MAP_FAILED ? 0 : (uintptr_t)m;
        return *va ? UMP_OK : ump__os_status(errno);
    }
    return ump__cu.memAddressReserve(va, bytes, p->gran, 0, 0);
}

static void ph_unreserve(pool_t *p, uintptr_t va, uint64_t bytes)
{
    if (p->provider == UMP_PROVIDER_HOST)
        munmap((void *)va, bytes);
    else
        ump__cu.memAddressFree(va, bytes);
}

static int ph_copy(pool_t *p, uintptr_t dst, uintptr_t src, uint64_t bytes)
{
    if (p->provider == UMP_PROVIDER_HOST) {
        memcpy((void *)dst, (const void *)src, bytes);
        return UMP_OK;
    }
    return ump__cu.memcpyDtoD(dst, src, bytes);
}

/* --- handles --------------------------------------------------------------- */

static region_t *region_of(pool_t *p, int region)
{
    return region == 0 ? &p->main : &p->bufs[region - 1];
}

/* Record a handle. `view`: v+1 for a handle view v owns; `imported`: the
 * memory is another process's, so it is not counted as the pool's. */
static int64_t handle_new(pool_t *p, uint64_t h, uint64_t ngran, int device, int view, int imported)
{
    size_t i;
    for (i = 0; i < p->nh; i++)
        if (p->hs[i].ngran == 0)
            break;
    if (i == p->nh) {
        if (p->nh == p->caph) {
            size_t cap = p->caph ? p->caph * 2 : 64;
            handle_t *hs = realloc(p->hs, cap * sizeof *hs);
            if (!hs)
                return -1;
            p->hs = hs;
            p->caph = cap;
        }
        p->nh++;
    }
    handle_t *e = &p->hs[i];
    memset(e, 0, sizeof *e);
    e->h = h;
    e->ngran = ngran;
    e->device = device;
    e->region = view ? view : -1;
    e->view = view;
    e->imported = imported;
    if (imported) {
        p->st.imported_bytes += ngran * p->gran;
        return (int64_t)i;
    }
    if (view)
        p->st.shared_bytes += ngran * p->gran;
    p->st.physical_bytes += ngran * p->gran;
    p->st.handles_created++;
    if (p->st.physical_bytes > p->st.peak_physical_bytes)
        p->st.peak_physical_bytes = p->st.physical_bytes;
    return (int64_t)i;
}

static void handle_drop(pool_t *p, int64_t i)
{
    handle_t *e = &p->hs[i];
    uint64_t bytes = e->ngran * p->gran;
    ph_release(p, e->h);
    e->ngran = 0;
    if (e->imported) {
        p->st.imported_bytes -= bytes;
        return;
    }
    if (e->view)
        p->st.shared_bytes -= bytes;
    p->st.physical_bytes -= bytes;
    p->st.handles_released++;
}

static void handle_place(pool_t *p, int64_t i, int region, uint64_t at)
{
    handle_t *e = &p->hs[i];
    region_t *r = region_of(p, region);
    e->region = region;
    e->at = at;
    e->busy = 0;
    for (uint64_t g = at; g < at + e->ngran; g++) {
        r->gh[g] = i;
        if (region != 0 || p->gref[g])
            e->busy++;
    }
    p->st.mapped_bytes += e->ngran * p->gran;
    p->st.maps++;
    if (p->st.mapped_bytes > p->st.peak_mapped_bytes)
        p->st.peak_mapped_bytes = p->st.mapped_bytes;
}

/* Unmap a handle; it stays held, in the cache. The caller synchronised. */
static int handle_unmap(pool_t *p, int64_t i)
{
    handle_t *e = &p->hs[i];
    region_t *r = region_of(p, e->region);
    int status = ph_unmap(p, r->va + e->at * p->gran, e->ngran * p->gran);
    for (uint64_t g = e->at; g < e->at + e->ngran; g++)
        r->gh[g] = -1;
    e->region = -1;
    p->st.mapped_bytes -= e->ngran * p->gran;
    p->st.unmaps++;
    return status;
}

/* The largest cached handle of the pool's device that fits in `ngran`. */
static int64_t cache_take(pool_t *p, uint64_t ngran)
{
    int64_t best = -1;
    for (size_t i = 0; i < p->nh; i++) {
        handle_t *e = &p->hs[i];
        if (e->ngran && e->region < 0 && e->device == p->device && e->ngran <= ngran &&
            (best < 0 || e->ngran > p->hs[best].ngran))
            best = (int64_t)i;
    }
    return best;
}

/* Unmap every handle of the main range that no live block touches. */
static uint64_t scavenge(pool_t *p)
{
    uint64_t n = 0;
    int synced = 0;
    for (size_t i = 0; i < p->nh; i++) {
        handle_t *e = &p->hs[i];
        if (e->ngran && e->region == 0 && e->busy == 0 && e->pins == 0) {
            /* A kernel queued before the blocks were freed may still read
             * these pages: unmapping them under it would fault. */
            if (!synced++)
                ph_sync(p);
            handle_unmap(p, (int64_t)i);
            n += e->ngran;
        }
    }
    return n;
}

/* Release cached handles (all of them, or those larger than `keep_below`
 * granules, which could not fill the run being mapped). */
static uint64_t release_cached(pool_t *p, uint64_t keep_below)
{
    uint64_t n = 0;
    for (size_t i = 0; i < p->nh; i++) {
        handle_t *e = &p->hs[i];
        if (e->ngran && e->region < 0 && (e->ngran > keep_below || e->device != p->device)) {
            n += e->ngran;
            handle_drop(p, (int64_t)i);
        }
    }
    return n;
}

/* --- transactions ----------------------------------------------------------
 * Each step of a multi-step mapping registers its own undo before it can be
 * needed: room in the log is reserved before the step, so recording it never
 * fails after the step succeeded. Rolling back runs the log backwards. */

typedef struct {
    enum { UNDO_UNMAP, UNDO_RELEASE } op;
    int64_t handle;
} undo_t;

typedef struct {
    undo_t *steps;
    size_t n, cap;
} undo_log_t;

/* Room for `more` steps. */
static int undo_reserve(undo_log_t *log, size_t more)
{
    if (log->n + more <= log->cap)
        return UMP_OK;
    size_t cap = log->cap ? log->cap * 2 : 16;
    while (cap < log->n + more)
        cap *= 2;
    undo_t *steps = realloc(log->steps, cap * sizeof *steps);
    if (!steps)
        return UMP_ERR_NOMEM;
    log->steps = steps;
    log->cap = cap;
    return UMP_OK;
}

/* Record a step; undo_reserve made room for it. */
static void undo_push(undo_log_t *log, int op, int64_t handle)
{
    log->steps[log->n].op = op;
    log->steps[log->n].handle = handle;
    log->n++;
}

static void undo_rollback(pool_t *p, undo_log_t *log)
{
    while (log->n--) {
        undo_t *u = &log->steps[log->n];
        if (u->op == UNDO_UNMAP)
            handle_unmap(p, u->handle);
        else
            handle_drop(p, u->handle);
    }
    p->st.rollbacks++;
}

/* Back granules [g0, g0+k) of a region, all unmapped, with handles and grant
 * access to them. A transaction: on failure every handle mapped here is
 * unmapped again, every handle created here released, and the status
 * returned. */
static int map_run(pool_t *p, int region, uint64_t g0, uint64_t k)
{
    region_t *r = region_of(p, region);
    undo_log_t log = {0};
    int tried_scavenge = 0, pushed;
    int status = ph_enter(p, &pushed);
    uint64_t pos = g0, left = k;
    if (status != UMP_OK)
        return status;
    while (left) {
        /* Room for this step's undos: unmap, and release if it is fresh. */
        status = undo_reserve(&log, 2);
        if (status != UMP_OK)
            goto undo;
        int64_t i = cache_take(p, left);
        if (i < 0 && !tried_scavenge) {
            /* Reuse idle physical memory before asking the driver for more:
             * that keeps what the pool holds close to what it uses. */
            tried_scavenge = 1;
            if (scavenge(p))
                continue;
        }
        if (i < 0) {
            /* Halving: a run of k granules gets handles of k/2, k/4, ..., 1
             * granules. Few mappings for a large request (log2 k + 1), yet
             * when the range is later reused by smaller blocks, most of its
             * physical memory sits in handles small enough to come free and
             * be scavenged. One handle per run held 14-21 % more memory
             * than the live blocks in a mixed-size workload; halving 4-7 %,
             * one granule per handle 3-4 % at 2.5 times the mappings. */
            uint64_t n = (left + 1) / 2;
            /* Cached handles left now are all larger than the run: release
             * them rather than hold them beside new memory. */
            release_cached(p, n);
            uint64_t limit = p->st.limit_bytes;
            if (limit && p->st.physical_bytes + n * p->gran > limit) {
                status = UMP_ERR_CAP;
                goto undo;
            }
            uint64_t h;
            status = ph_create(p, n * p->gran, p->device, 0, &h);
            /* Out of device memory: the cached handles this run could not
             * use may make room (idle mappings were scavenged above). */
            if ((status == CUDA_ERROR_OUT_OF_MEMORY || status == UMP_ERR_NOMEM) &&
                release_cached(p, 0))
                status = ph_create(p, n * p->gran, p->device, 0, &h);
            if (status != UMP_OK)
                goto undo;
            i = handle_new(p, h, n, p->device, 0, 0);
            if (i < 0) {
                ph_release(p, h);
                status = UMP_ERR_NOMEM;
                goto undo;
            }
            undo_push(&log, UNDO_RELEASE, i);
        }
        status = ph_map(p, r->va + pos * p->gran, p->hs[i].ngran * p->gran, p->hs[i].h);
        if (status != UMP_OK)
            goto undo;
        handle_place(p, i, region, pos);
        undo_push(&log, UNDO_UNMAP, i);
        pos += p->hs[i].ngran;
        left -= p->hs[i].ngran;
    }
    /* Map ahead: cached handles are held anyway, so mapping some of them
     * behind the run costs no memory, and one set-access (the expensive
     * step) then covers them too; the next blocks placed there need no
     * mapping at all. They stay idle, so scavenging can still take them. */
    while (region == 0 && pos < g0 + k + MAP_AHEAD && undo_reserve(&log, 1) == UMP_OK) {
        uint64_t room = 0;
        while (pos + room < g0 + k + MAP_AHEAD && pos + room < r->ngran &&
               r->gh[pos + room] < 0 && p->gref[pos + room] == 0)
            room++;
        int64_t i = room ? cache_take(p, room) : -1;
        if (i < 0 || ph_map_raw(p, r->va + pos * p->gran, p->hs[i].ngran * p->gran, p->hs[i].h))
            break;
        handle_place(p, i, region, pos);
        undo_push(&log, UNDO_UNMAP, i);
        pos += p->hs[i].ngran;
    }
    status = ump__injected_failure();
    if (status == UMP_OK)
        status = ph_access(p, r->va + g0 * p->gran, (pos - g0) * p->gran);
    if (status == UMP_OK)
        goto out;
undo:
    undo_rollback(p, &log);
out:
    free(log.steps);
    ph_leave(p, pushed);
    return status;
}

/* --- blocks ---------------------------------------------------------------- */

static int bin_of(uint64_t bytes)
{
    uint64_t units = bytes / UMP_ALIGN;
    int b = 63 - __builtin_clzll(units);
    int sub = b >= 2 ? (int)((units >> (b - 2)) & 3) : 0;
    int i = b * 4 + sub;
    return i < NBINS ? i : NBINS - 1;
}

/* The bins of a stream that holds free blocks, or NULL. */
static sbins_t *bins_for(pool_t *p, uintptr_t stream)
{
    for (int i = 0; i < p->nsb; i++)
        if (p->sb[i].stream == stream)
            return &p->sb[i];
    return NULL;
}

/* The stream has bins, or there is room for them: make_room ran first. */
static void bin_insert(pool_t *p, blk_t *b)
{
    sbins_t *sb = bins_for(p, b->stream);
    if (!sb) {
        sb = &p->sb[p->nsb++];
        memset(sb, 0, sizeof *sb);
        sb->stream = b->stream;
    }
    b->bin = bin_of(b->size);
    b->fprev = NULL;
    b->fnext = sb->bin[b->bin];
    if (b->fnext)
        b->fnext->fprev = b;
    sb->bin[b->bin] = b;
    sb->nfree++;
}

/* Take a free block out of its bins; the stream's bins go with its last. */
static void bin_remove(pool_t *p, blk_t *b)
{
    sbins_t *sb = bins_for(p, b->stream);
    if (b->fprev)
        b->fprev->fnext = b->fnext;
    else
        sb->bin[b->bin] = b->fnext;
    if (b->fnext)
        b->fnext->fprev = b->fprev;
    b->bin = -1;
    if (--sb->nfree == 0)
        *sb = p->sb[--p->nsb];
}

/* Best fit among the stream's free blocks (sb NULL: it has none). */
static blk_t *find_fit(sbins_t *sb, uint64_t size)
{
    if (!sb)
        return NULL;
    int i0 = bin_of(size);
    blk_t *best = NULL;
    for (blk_t *b = sb->bin[i0]; b; b = b->fnext)
        if (b->size >= size && (!best || b->size < best->size))
            best = b;
    for (int i = i0 + 1; !best && i < NBINS; i++)
        for (blk_t *b = sb->bin[i]; b; b = b->fnext)
            if (!best || b->size < best->size)
                best = b;
    return best;
}

static blk_t *blk_new(uint64_t off, uint64_t size, uintptr_t stream)
{
    blk_t *b = calloc(1, sizeof *b);
    if (b) {
        b->off = off;
        b->size = size;
        b->stream = stream;
        b->bin = -1;
    }
    return b;
}

static void link_after(pool_t *p, blk_t *a, blk_t *b)
{
    b->prev = a;
    b->next = a ? a->next : NULL;
    if (b->next)
        b->next->prev = b;
    if (a)
        a->next = b;
    if (p->last == a)
        p->last = b;
}

static void unlink_blk(pool_t *p, blk_t *b)
{
    if (b->prev)
        b->prev->next = b->next;
    if (b->next)
        b->next->prev = b->prev;
    if (p->last == b)
        p->last = b->prev;
}

/* Merge a free block with free neighbours of the same stream; bin it. */
static void release_blk(pool_t *p, blk_t *b)
{
    blk_t *n = b->next, *q = b->prev;
    if (n && n->bin >= 0 && n->stream == b->stream) {
        bin_remove(p, n);
        b->size += n->size;
        unlink_blk(p, n);
        free(n);
    }
    if (q && q->bin >= 0 && q->stream == b->stream) {
        bin_remove(p, q);
        q->size += b->size;
        unlink_blk(p, b);
        free(b);
        b = q;
    }
    bin_insert(p, b);
}

static size_t live_find(pool_t *p, uint64_t off)
{
    size_t lo = 0, hi = p->nlive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (p->live[mid]->off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int live_insert(pool_t *p, blk_t *b)
{
    if (p->nlive == p->caplive) {
        size_t cap = p->caplive ? p->caplive * 2 : 256;
        blk_t **l = realloc(p->live, cap * sizeof *l);
        if (!l)
            return UMP_ERR_NOMEM;
        p->live = l;
        p->caplive = cap;
    }
    size_t i = live_find(p, b->off);
    memmove(&p->live[i + 1], &p->live[i], (p->nlive - i) * sizeof *p->live);
    p->live[i] = b;
    p->nlive++;
    return UMP_OK;
}

static void untouch(pool_t *p, blk_t *b)
{
    uint64_t g0 = b->off / p->gran, g1 = (b->off + b->size - 1) / p->gran;
    for (uint64_t g = g0; g <= g1; g++)
        if (--p->gref[g] == 0 && p->main.gh[g] >= 0)
            p->hs[p->main.gh[g]].busy--;
}

/* Count a block's granules as touched; map those that are not backed. */
static int touch(pool_t *p, blk_t *b)
{
    uint64_t g0 = b->off / p->gran, g1 = (b->off + b->size - 1) / p->gran;
    for (uint64_t g = g0; g <= g1; g++)
        if (p->gref[g]++ == 0 && p->main.gh[g] >= 0)
            p->hs[p->main.gh[g]].busy++;
    int status = UMP_OK;
    for (uint64_t g = g0; g <= g1 && status == UMP_OK;) {
        if (p->main.gh[g] >= 0) {
            g++;
            continue;
        }
        uint64_t e = g;
        while (e <= g1 && p->main.gh[e] < 0)
            e++;
        status = map_run(p, 0, g, e - g);
        g = e;
    }
    if (status != UMP_OK)
        untouch(p, b); /* runs mapped before the failing one stay, idle */
    return status;
}

/* Where a block cut at top for `stream` starts: the last block if it is
 * free on that stream (it grows into the unused range), else top. */
static uint64_t tail_start(pool_t *p, uintptr_t stream)
{
    blk_t *l = p->last;
    return l && l->bin >= 0 && l->stream == stream ? l->off : p->top;
}

/* After a device-wide synchronisation, free blocks of every stream may be
 * handed out on any stream: retag them all and merge neighbours. */
static void merge_streams(pool_t *p, uintptr_t stream)
{
    ph_sync(p);
    blk_t *b = p->last;
    while (b && b->prev)
        b = b->prev;
    for (; b; b = b->next)
        if (b->bin >= 0) {
            bin_remove(p, b);
            b->stream = stream;
            b->bin = NBINS; /* free, not binned: merged below */
        }
    b = p->last;
    while (b && b->prev)
        b = b->prev;
    while (b) {
        blk_t *n = b->next;
        if (b->bin == NBINS) {
            while (n && n->bin == NBINS) {
                b->size += n->size;
                unlink_blk(p, n);
                blk_t *nn = n->next;
                free(n);
                n = nn;
            }
            bin_insert(p, b);
        }
        b = n;
    }
}

/* Before a block of `stream` may enter the bins: room for the stream's
 * bins if it has none (see MAX_STREAM_BINS). */
static void make_room(pool_t *p, uintptr_t stream)
{
    if (p->nsb == MAX_STREAM_BINS && !bins_for(p, stream))
        merge_streams(p, stream);
}

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

/* Pin pool `id` and take its lock. UMP_ERR_ARG for an id no pool can have,
 * UMP_ERR_HANDLE for one that names no open pool (never did, or destroyed). */
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

/* --- public API ---------------------------------------------------------- */

int ump_vmm_create(int provider, int device, uintptr_t ctx, uint64_t va_bytes, uint64_t limit,
                   int *pool)
{
    if (!pool || (provider != UMP_PROVIDER_HOST && provider != UMP_PROVIDER_DEVICE) ||
        device < 0 || va_bytes == 0 || va_bytes > ((uint64_t)1 << 48))
        return fail(UMP_ERR_ARG);
    uint64_t gran;
    if (provider == UMP_PROVIDER_DEVICE) {
        int status = ump__cuda_ready();
        if (status == UMP_OK && !ump__cu.vmm)
            status = UMP_ERR_NOCUDA; /* a driver without the VMM API */
        if (status != UMP_OK)
            return fail(status);
        CUmemAllocationProp prop = prop_for(device, 0);
        size_t g = 0;
        int pushed = ump__ctx_enter((void *)ctx);
        status = ump__cu.memGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
        ump__ctx_leave(pushed);
        if (status != CUDA_SUCCESS || g == 0)
            return fail(status ? status : UMP_ERR_ARG);
        gran = g;
    } else {
        gran = (uint64_t)2 << 20; /* the granularity of the GPUs we measured */
    }
    pthread_mutex_lock(&pools_lock);
    int id = -1;
    for (int i = 0; i < UMP_MAX_POOLS; i++)
        if (!pools[i].used) {
            id = i;
            break;
        }
    if (id < 0) {
        pthread_mutex_unlock(&pools_lock);
        return fail(UMP_ERR_ARG);
    }
    pool_t *p = &pools[id];
    memset(p, 0, sizeof *p);
    p->provider = provider;
    p->device = device;
    p->ctx = (void *)ctx;
    p->gran = gran;
    p->ndev = 1;
    p->devs[0] = device;
    p->main.ngran = (va_bytes + gran - 1) / gran;
    p->main.live = 1;
    p->gref = calloc(p->main.ngran, sizeof *p->gref);
    p->main.gh = malloc(p->main.ngran * sizeof *p->main.gh);
    p->sb = malloc(MAX_STREAM_BINS * sizeof *p->sb);
    int status = p->gref && p->main.gh && p->sb ? UMP_OK : UMP_ERR_NOMEM;
    if (status == UMP_OK) {
        memset(p->main.gh, 0xff, p->main.ngran * sizeof *p->main.gh);
        int pushed;
        status = ph_enter(p, &pushed);
        if (status == UMP_OK)
            status = ph_reserve(p, p->main.ngran * gran, &p->main.va);
        ph_leave(p, pushed);
    }
    if (status != UMP_OK) {
        free(p->gref);
        free(p->main.gh);
        free(p->sb);
        memset(p, 0, sizeof *p);
        pthread_mutex_unlock(&pools_lock);
        return fail(status);
    }
    pthread_mutex_init(&p->lock, NULL);
    p->st.reserved_bytes = p->main.ngran * gran;
    p->st.limit_bytes = limit;
    p->st.granularity = gran;
    p->used = 1;
    __atomic_fetch_add(&n_pools_used, 1, __ATOMIC_RELEASE);
    *pool = pool_id(p);
    pthread_mutex_unlock(&pools_lock);
    return UMP_OK;
}

uintptr_t ump_vmm_alloc(int id, uint64_t size, uintptr_t stream)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status == UMP_OK && (p->inherited || size > p->main.ngran * p->gran)) {
        /* A forked child's copy would hand out the parent's memory. */
        status = p->inherited ? UMP_ERR_FORKED : UMP_ERR_RANGE;
        pool_leave(p);
    }
    if (status != UMP_OK) {
        fail(status);
        return 0;
    }
    uint64_t need = size ? (size + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN;
    uint64_t end = p->main.ngran * p->gran;
    uintptr_t ptr = 0;
    blk_t *b = find_fit(bins_for(p, stream), need);
    if (!b && tail_start(p, stream) + need > end) {
        merge_streams(p, stream);
        b = find_fit(bins_for(p, stream), need);
    }
    if (b) {
        bin_remove(p, b);
        if (b->size - need >= UMP_ALIGN) {
            blk_t *rest = blk_new(b->off + need, b->size - need, b->stream);
            if (!rest) {
                bin_insert(p, b);
                b = NULL;
                status = UMP_ERR_NOMEM;
                goto out;
            }
            b->size = need;
            link_after(p, b, rest);
            bin_insert(p, rest);
        }
    } else {
        uint64_t at = tail_start(p, stream);
        if (at + need > end) {
            status = UMP_ERR_RANGE; /* blocks never move: live ones fill the range */
            goto out;
        }
        if (at < p->top) {
            b = p->last; /* free but too small: it grows past top */
            bin_remove(p, b);
            b->size = need;
        } else {
            b = blk_new(at, need, stream);
            if (!b) {
                status = UMP_ERR_NOMEM;
                goto out;
            }
            link_after(p, p->last, b);
        }
        p->top = at + need;
    }
    b->stream = stream;
    status = touch(p, b);
    if (status == UMP_OK) {
        status = live_insert(p, b);
        if (status != UMP_OK)
            untouch(p, b);
    }
    if (status != UMP_OK) {
        make_room(p, b->stream);
        release_blk(p, b);
        b = NULL;
        goto out;
    }
    p->st.used_bytes += need;
    p->st.current_count++;
    p->st.total_bytes += need;
    p->st.total_count++;
    if (p->st.used_bytes > p->st.peak_used_bytes)
        p->st.peak_used_bytes = p->st.used_bytes;
    if (p->st.current_count > p->st.peak_count)
        p->st.peak_count = p->st.current_count;
    ptr = p->main.va + b->off;
out:
    if (status != UMP_OK)
        p->st.failures++;
    pool_leave(p);
    if (!ptr)
        fail(status);
    return ptr;
}

int ump_vmm_free(int id, uintptr_t ptr)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    uint64_t off = ptr - p->main.va;
    size_t i = live_find(p, off);
    if (ptr < p->main.va || i == p->nlive || p->live[i]->off != off) {
        p->st.bad_frees++;
        pool_leave(p);
        return fail(UMP_ERR_ARG);
    }
    blk_t *b = p->live[i];
    memmove(&p->live[i], &p->live[i + 1], (p->nlive - i - 1) * sizeof *p->live);
    p->nlive--;
    untouch(p, b);
    p->st.used_bytes -= b->size;
    p->st.current_count--;
    make_room(p, b->stream);
    release_blk(p, b);
    pool_leave(p);
    return UMP_OK;
}

int ump_vmm_trim(int id, int keep_handles)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    int pushed;
    status = ph_enter(p, &pushed);
    if (status == UMP_OK) {
        scavenge(p);
        if (!keep_handles)
            release_cached(p, 0);
    }
    ph_leave(p, pushed);
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

int ump_vmm_set_limit(int id, uint64_t limit)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    p->st.limit_bytes = limit;
    int pushed;
    /* Memory over the new limit that no live block uses goes back now, on
     * either physical layer (a forked child's copy gives back nothing). */
    if (limit && p->st.physical_bytes > limit && ph_enter(p, &pushed) == UMP_OK) {
        scavenge(p);
        release_cached(p, 0);
        ph_leave(p, pushed);
    }
    pool_leave(p);
    return UMP_OK;
}

int ump_vmm_stats(int id, ump_vmm_stats_t *out)
{
    if (!out)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    *out = p->st;
    out->cached_bytes = p->st.physical_bytes - p->st.mapped_bytes - p->st.shared_bytes;
    uint64_t idle = 0;
    for (size_t i = 0; i < p->nh; i++)
        if (p->hs[i].ngran && p->hs[i].region == 0 && p->hs[i].busy == 0 && !p->hs[i].pins)
            idle += p->hs[i].ngran * p->gran;
    out->idle_bytes = idle;
    out->handles = 0;
    for (size_t i = 0; i < p->nh; i++)
        out->handles += p->hs[i].ngran != 0;
    out->stream_bins = (uint64_t)p->nsb;
    pool_leave(p);
    return UMP_OK;
}

/* Apply the pool's access list to every mapped run of a region. */
static int grant_region(pool_t *p, region_t *r)
{
    int status = UMP_OK;
    for (uint64_t g = 0; g < r->ngran && status == UMP_OK;) {
        if (r->gh[g] < 0) {
            g++;
            continue;
        }
        uint64_t e = g;
        while (e < r->ngran && r->gh[e] >= 0)
            e++;
        status = ph_access(p, r->va + g * p->gran, (e - g) * p->gran);
        g = e;
    }
    return status;
}

int ump_vmm_grant(int id, int device)
{
    if (device < 0)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    int i;
    for (i = 0; i < p->ndev; i++)
        if (p->devs[i] == device)
            break;
    if (i == p->ndev) {
        if (p->ndev == MAX_DEVICES) {
            status = UMP_ERR_ARG;
        } else {
            int pushed;
            p->devs[p->ndev++] = device;
            status = ph_enter(p, &pushed);
            if (status == UMP_OK)
                status = grant_region(p, &p->main);
            for (int b = 0; b < p->nbufs && status == UMP_OK; b++)
                if (p->bufs[b].live)
                    status = grant_region(p, &p->bufs[b]);
            ph_leave(p, pushed);
            if (status != UMP_OK)
                p->ndev--;
        }
    }
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

int ump_vmm_devices(int id, int *out, int max, int *n)
{
    if (!n || max < 0 || (max && !out))
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    *n = p->ndev;
    for (int i = 0; i < p->ndev && i < max; i++)
        out[i] = p->devs[i];
    pool_leave(p);
    return UMP_OK;
}

/* --- growable buffers: a reservation of their own, mapped from the front -- */

static region_t *buffer_get(pool_t *p, int buf)
{
    return buf >= 0 && buf < p->nbufs && p->bufs[buf].live && p->bufs[buf].kind == REGION_BUFFER
               ? &p->bufs[buf]
               : NULL;
}

/* A region slot of `kind` with a reservation of `ngran` granules, nothing
 * mapped. Under the pool's lock. */
static int region_open(pool_t *p, int kind, uint64_t ngran, int *idx)
{
    int b;
    for (b = 0; b < p->nbufs; b++)
        if (!p->bufs[b].live)
            break;
    if (b == p->nbufs) {
        region_t *bufs = realloc(p->bufs, (size_t)(p->nbufs + 1) * sizeof *bufs);
        if (!bufs)
            return UMP_ERR_NOMEM;
        p->bufs = bufs;
        memset(&bufs[p->nbufs++], 0, sizeof *bufs);
    }
    region_t *r = &p->bufs[b];
    r->gh = malloc(ngran * sizeof *r->gh);
    if (!r->gh)
        return UMP_ERR_NOMEM;
    memset(r->gh, 0xff, ngran * sizeof *r->gh);
    int pushed, status = ph_enter(p, &pushed);
    if (status == UMP_OK)
        status = ph_reserve(p, ngran * p->gran, &r->va);
    ph_leave(p, pushed);
    if (status != UMP_OK) {
        free(r->gh);
        memset(r, 0, sizeof *r);
        return status;
    }
    r->ngran = ngran;
    r->kind = kind;
    r->live = 1;
    r->size = 0;
    p->st.reserved_bytes += ngran * p->gran;
    *idx = b;
    return UMP_OK;
}

int ump_vmm_buffer_create(int id, uint64_t max_bytes, int *buf)
{
    if (!buf || max_bytes == 0 || max_bytes > UMP_VMM_MAX_BYTES)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    status = region_open(p, REGION_BUFFER, (max_bytes + p->gran - 1) / p->gran, buf);
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* The address of a buffer or view (fixed for its life), its bytes in use or
 * mapped, and (times not NULL) how long making it took; `get` finds region
 * `idx` of its sort. */
static int region_info(int id, region_t *(*get)(pool_t *, int), int idx, uintptr_t *ptr,
                       uint64_t *size, ump_vmm_view_times_t *times)
{
    if (!ptr || !size)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    region_t *r = get(p, idx);
    if (r) {
        *ptr = r->va;
        *size = r->size;
        if (times)
            *times = r->times;
    }
    pool_leave(p);
    return r ? UMP_OK : fail(UMP_ERR_ARG);
}

int ump_vmm_buffer_info(int id, int buf, uintptr_t *ptr, uint64_t *size)
{
    return region_info(id, buffer_get, buf, ptr, size, NULL);
}

/* Unmap the handles of a region that lie wholly at or past granule `from`;
 * the caller synchronised. */
static void unmap_from(pool_t *p, int region, uint64_t from)
{
    region_t *r = region_of(p, region);
    for (uint64_t g = from; g < r->ngran; g++) {
        int64_t i = r->gh[g];
        if (i >= 0 && p->hs[i].at >= from)
            handle_unmap(p, i);
    }
}

int ump_vmm_buffer_resize(int id, int buf, uint64_t bytes)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    region_t *r = buffer_get(p, buf);
    if (!r || bytes > r->ngran * p->gran) {
        status = UMP_ERR_ARG; /* past its reservation the address would change */
    } else {
        uint64_t need = (bytes + p->gran - 1) / p->gran, have = 0;
        while (have < r->ngran && r->gh[have] >= 0)
            have++;
        if (need > have) {
            status = map_run(p, buf + 1, have, need - have);
        } else if (need < have) {
            status = ph_sync(p); /* a kernel may still use the tail */
            if (status == UMP_OK)
                unmap_from(p, buf + 1, need);
        }
        if (status == UMP_OK) {
            p->st.buffer_bytes = p->st.buffer_bytes - r->size + bytes;
            r->size = bytes;
        }
    }
    if (status != UMP_OK)
        p->st.failures++;
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

int ump_vmm_buffer_destroy(int id, int buf)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    region_t *r = buffer_get(p, buf);
    status = r ? ph_sync(p) : UMP_ERR_ARG;
    if (status == UMP_OK) {
        int pushed;
        unmap_from(p, buf + 1, 0);
        ph_enter(p, &pushed);
        ph_unreserve(p, r->va, r->ngran * p->gran);
        ph_leave(p, pushed);
        p->st.reserved_bytes -= r->ngran * p->gran;
        p->st.buffer_bytes -= r->size;
        free(r->gh);
        memset(r, 0, sizeof *r);
    }
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* --- migration --------------------------------------------------------------
 * Moving a handle to another device keeps its virtual address: create a
 * handle there, map it at a scratch reservation, copy, then swap the
 * mappings and grant access again. A remapped range starts with no access at
 * all, which is why a kernel touching it without cuMemSetAccess fails with
 * "unspecified launch failure". Each handle is its own transaction: until the
 * swap the old mapping is untouched, and if the swap fails the old handle,
 * whose contents did not change, is mapped back. */
static int migrate_handle(pool_t *p, int64_t i, int device)
{
    handle_t *e = &p->hs[i];
    region_t *r = region_of(p, e->region);
    uintptr_t va = r->va + e->at * p->gran, tmp = 0;
    uint64_t bytes = e->ngran * p->gran, nh;
    int status = ph_create(p, bytes, device, 0, &nh);
    if (status != UMP_OK)
        return status;
    status = ph_reserve(p, bytes, &tmp);
    if (status == UMP_OK) {
        status = ph_map(p, tmp, bytes, nh);
        if (status == UMP_OK) {
            status = ph_access(p, tmp, bytes);
            if (status == UMP_OK)
                status = ph_copy(p, tmp, va, bytes);
            if (status == UMP_OK)
                status = ph_sync(p);
            ph_unmap(p, tmp, bytes);
        }
        ph_unreserve(p, tmp, bytes);
    }
    if (status == UMP_OK) {
        status = ph_unmap(p, va, bytes);
        if (status == UMP_OK) {
            status = ph_map(p, va, bytes, nh);
            if (status == UMP_OK)
                status = ph_access(p, va, bytes);
            if (status != UMP_OK) {
                ph_unmap(p, va, bytes);
                ph_map(p, va, bytes, e->h);
                ph_access(p, va, bytes);
            }
        }
    }
    if (status != UMP_OK) {
        ph_release(p, nh);
        p->st.rollbacks++;
        return status;
    }
    ph_release(p, e->h);
    e->h = nh;
    e->device = device;
    p->st.handles_created++;
    p->st.handles_released++;
    p->st.migrations++;
    return UMP_OK;
}

static region_t *region_at(pool_t *p, uintptr_t ptr, int *region)
{
    if (ptr >= p->main.va && ptr < p->main.va + p->main.ngran * p->gran) {
        *region = 0;
        return &p->main;
    }
    for (int b = 0; b < p->nbufs; b++) {
        region_t *r = &p->bufs[b];
        if (r->live && ptr >= r->va && ptr < r->va + r->ngran * p->gran) {
            *region = b + 1;
            return r;
        }
    }
    return NULL;
}

int ump_vmm_migrate(int id, uintptr_t ptr, uint64_t bytes, int device)
{
    if (bytes == 0 || device < 0)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    int region, granted = 0;
    region_t *r = region_at(p, ptr, &region);
    for (int d = 0; d < p->ndev; d++)
        granted |= p->devs[d] == device;
    /* region_at: ptr >= r->va, so the end is not below ptr (ptr + bytes may wrap) */
    if (!r || !granted || bytes > r->va + r->ngran * p->gran - ptr ||
        (region != 0 && r->kind != REGION_BUFFER))
        status = UMP_ERR_ARG; /* a view's handles are mapped elsewhere too, or not ours */
    uint64_t g0 = 0, g1 = 0;
    if (status == UMP_OK) {
        g0 = (ptr - r->va) / p->gran;
        g1 = (ptr + bytes - 1 - r->va) / p->gran;
        for (uint64_t g = g0; g <= g1; g++)
            if (r->gh[g] < 0 || p->hs[r->gh[g]].pins)
                status = UMP_ERR_ARG; /* not backed, or an alias maps it too */
    }
    int pushed = 0;
    if (status == UMP_OK)
        status = ph_enter(p, &pushed);
    if (status == UMP_OK)
        status = ph_sync(p); /* no kernel may use the old pages during the copy */
    for (uint64_t g = g0; g <= g1 && status == UMP_OK;) {
        int64_t i = r->gh[g];
        g = p->hs[i].at + p->hs[i].ngran;
        if (p->hs[i].device != device)
            status = migrate_handle(p, i, device);
    }
    ph_leave(p, pushed);
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* The device each byte of [ptr, ptr+bytes) lives on, if one; -1 if mixed. */
int ump_vmm_device_of(int id, uintptr_t ptr, uint64_t bytes, int *device)
{
    if (bytes == 0 || !device)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    int region, dev = -2;
    region_t *r = region_at(p, ptr, &region);
    if (r && bytes <= r->va + r->ngran * p->gran - ptr) {
        for (uint64_t g = (ptr - r->va) / p->gran; g <= (ptr + bytes - 1 - r->va) / p->gran; g++) {
            int d = r->gh[g] < 0 ? -3 : p->hs[r->gh[g]].device;
            dev = dev == -2 ? d : (dev == d ? dev : -1);
        }
    }
    pool_leave(p);
    if (dev < -1)
        return fail(UMP_ERR_ARG);
    *device = dev;
    return UMP_OK;
}

/* --- views ------------------------------------------------------------------
 * A view is a region with a reservation of its own over physical memory that
 * is either its own (shared, ring, striped), another process's (imported), or
 * the main range's (an alias). Its gh records each mapping, a handle's
 * `view` the handles it owns, a handle's `pins` the aliases that map it:
 * that record is also the undo log, so a view that fails half-way is taken
 * apart by the same view_close that ends a finished one.
 *
 * A pinned handle stays where it is: scavenging and migration leave it alone
 * (an alias would keep the old memory while the block moved to new). A
 * view's own handles are never cached, scavenged or trimmed; they go when the
 * view does. Physical memory another process imported stays alive there
 * after the view releases its handle: the driver (or the kernel, for a memfd)
 * frees it when the last process lets go. */

static int view_kind(int kind) { return kind >= REGION_SHARED; }

static region_t *view_get(pool_t *p, int v)
{
    return v >= 0 && v < p->nbufs && p->bufs[v].live && view_kind(p->bufs[v].kind) ? &p->bufs[v]
                                                                                 : NULL;
}

/* Unmap, release what it owns, unpin what it borrows, free the reservation.
 * The caller synchronised (or nothing ran on it yet). */
static void view_close(pool_t *p, int v)
{
    region_t *r = &p->bufs[v];
    for (uint64_t g = 0; g < r->ngran;) {
        int64_t i = r->gh[g];
        if (i < 0) {
            g++;
            continue;
        }
        ph_unmap(p, r->va + g * p->gran, p->hs[i].ngran * p->gran);
        if (r->kind == REGION_ALIAS)
            p->hs[i].pins--;
        p->st.view_bytes -= p->hs[i].ngran * p->gran;
        g += p->hs[i].ngran;
    }
    for (size_t i = 0; i < p->nh; i++)
        if (p->hs[i].ngran && p->hs[i].view == v + 1)
            handle_drop(p, (int64_t)i);
    ph_unreserve(p, r->va, r->ngran * p->gran);
    p->st.reserved_bytes -= r->ngran * p->gran;
    p->st.views--;
    free(r->gh);
    memset(r, 0, sizeof *r);
}

/* Open a view of `ngran` granules that creates `creates` bytes of physical
 * memory: enter the device, reserve. A view larger than the limit is
 * refused before its reservation and granule map cost anything. */
static int view_begin(pool_t *p, int kind, uint64_t ngran, uint64_t creates, int *v, int *pushed)
{
    *v = -1;
    int status = ph_enter(p, pushed);
    if (status == UMP_OK && p->st.limit_bytes && creates > p->st.limit_bytes)
        status = UMP_ERR_CAP;
    if (status == UMP_OK && p->provider != UMP_PROVIDER_HOST && !ump__cu.share &&
        (kind == REGION_SHARED || kind == REGION_IMPORTED))
        status = UMP_ERR_UNSUPPORTED;
    uint64_t t0 = now_ns();
    if (status == UMP_OK)
        status = region_open(p, kind, ngran, v);
    if (status == UMP_OK) {
        p->st.views++;
        p->bufs[*v].times = (ump_vmm_view_times_t){.reserve_ns = now_ns() - t0};
    } else {
        *v = -1;
    }
    return status;
}

/* Grant access to the whole view; on any failure take it apart. */
static int view_end(pool_t *p, int v, int status, int pushed)
{
    if (status == UMP_OK) {
        region_t *r = &p->bufs[v];
        uint64_t t0 = now_ns();
        status = ump__injected_failure();
        if (status == UMP_OK)
            status = ph_access(p, r->va, r->ngran * p->gran);
        r->times.access_ns += now_ns() - t0;
        if (status == UMP_OK)
            r->size = r->ngran * p->gran;
    }
    if (status != UMP_OK) {
        if (v >= 0) {
            view_close(p, v);
            p->st.rollbacks++;
        }
        p->st.failures++;
    }
    ph_leave(p, pushed);
    return status;
}

/* A handle of `ngran` granules on `device`, owned by view v. */
static int view_handle(pool_t *p, int v, uint64_t ngran, int device, int exportable, int64_t *out)
{
    uint64_t bytes = ngran * p->gran, limit = p->st.limit_bytes, h;
    if (limit && p->st.physical_bytes + bytes > limit)
        release_cached(p, 0);
    if (limit && p->st.physical_bytes + bytes > limit)
        return UMP_ERR_CAP;
    uint64_t t0 = now_ns();
    int status = ph_create(p, bytes, device, exportable, &h);
    if ((status == CUDA_ERROR_OUT_OF_MEMORY || status == UMP_ERR_NOMEM) && release_cached(p, 0))
        status = ph_create(p, bytes, device, exportable, &h);
    p->bufs[v].times.physical_ns += now_ns() - t0;
    if (status != UMP_OK)
        return status;
    *out = handle_new(p, h, ngran, device, v + 1, 0);
    if (*out < 0) {
        ph_release(p, h);
        return UMP_ERR_NOMEM;
    }
    return UMP_OK;
}

/* Map handle i at granule g of view v. */
static int view_map(pool_t *p, int v, uint64_t g, int64_t i)
{
    region_t *r = &p->bufs[v];
    handle_t *e = &p->hs[i];
    uint64_t t0 = now_ns();
    int status = ph_map(p, r->va + g * p->gran, e->ngran * p->gran, e->h);
    r->times.map_ns += now_ns() - t0;
    if (status != UMP_OK)
        return status;
    for (uint64_t k = 0; k < e->ngran; k++)
        r->gh[g + k] = i;
    if (r->kind == REGION_ALIAS)
        e->pins++;
    p->st.view_bytes += e->ngran * p->gran;
    return UMP_OK;
}

static uint64_t granules(pool_t *p, uint64_t bytes) { return (bytes + p->gran - 1) / p->gran; }

/* What every view's maker returns: its id through *view, or the status. */
static int view_made(int v, int status, int *view)
{
    if (status != UMP_OK)
        return fail(status);
    *view = v;
    return UMP_OK;
}

int ump_vmm_shared_create(int id, uint64_t bytes, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    int v, pushed;
    int64_t i;
    status = view_begin(p, REGION_SHARED, granules(p, bytes), granules(p, bytes) * p->gran, &v, &pushed);
    if (status == UMP_OK)
        status = view_handle(p, v, granules(p, bytes), p->device, 1, &i);
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    status = view_end(p, v, status, pushed);
    pool_leave(p);
    return view_made(v, status, view);
}

int ump_vmm_export(int id, int view, int *fd)
{
    if (!fd)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    region_t *r = view_get(p, view);
    int pushed = 0;
    status = r && r->kind == REGION_SHARED ? ph_enter(p, &pushed) : UMP_ERR_ARG;
    if (status == UMP_OK)
        status = ump__injected_failure();
    if (status == UMP_OK)
        status = ph_export(p, p->hs[r->gh[0]].h, fd);
    if (status == UMP_OK)
        p->st.exports++;
    ph_leave(p, pushed);
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* Check a peer's descriptor and take a handle of our own for it, before
 * anything is reserved or allocated for the size the peer claims. */
static int import_take(pool_t *p, int fd, uint64_t bytes, uint64_t *h, int *device,
                       uint64_t *took_ns)
{
    uint64_t t0 = now_ns();
    int status = UMP_OK;
    if (p->provider != UMP_PROVIDER_HOST && !ump__cu.share)
        status = UMP_ERR_UNSUPPORTED;
    if (status == UMP_OK)
        status = ump__injected_failure();
    if (status == UMP_OK)
        status = ph_import(p, fd, bytes, h, device);
    *took_ns = now_ns() - t0;
    return status;
}

int ump_vmm_import(int id, int fd, uint64_t bytes, int device, int *view)
{
    if (!view || fd < 0 || bytes == 0)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    if (bytes % p->gran || bytes > UMP_VMM_MAX_BYTES) {
        pool_leave(p);
        return fail(UMP_ERR_HANDLE); /* not the size of any memory we export */
    }
    int v = -1, pushed, inner = 0, taken = 0;
    int64_t i = -1;
    uint64_t h = 0, took_ns = 0;
    status = ph_enter(p, &pushed);
    if (status == UMP_OK)
        status = import_take(p, fd, bytes, &h, &device, &took_ns);
    taken = status == UMP_OK;
    if (status == UMP_OK)
        status = view_begin(p, REGION_IMPORTED, bytes / p->gran, 0, &v, &inner);
    if (status == UMP_OK) {
        p->bufs[v].times.physical_ns = took_ns;
        i = handle_new(p, h, bytes / p->gran, device, v + 1, 1);
        if (i < 0)
            status = UMP_ERR_NOMEM;
    }
    if (taken && i < 0)
        ph_release(p, h); /* recorded nowhere: no view would release it */
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    status = view_end(p, v, status, inner);
    ph_leave(p, pushed);
    pool_leave(p);
    return view_made(v, status, view);
}

/* Map the handles under [ptr, ptr+bytes) of one live block a second time.
 * cuMemMap maps whole handles only (its offset must be 0), so the alias
 * spans the handles' granules; *alias is where ptr appears in it. */
int ump_vmm_alias_create(int id, uintptr_t ptr, uint64_t bytes, uintptr_t *alias, int *view)
{
    if (bytes == 0 || !alias || !view)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    uint64_t off = ptr - p->main.va;
    size_t k = ptr >= p->main.va ? live_find(p, off + 1) : 0;
    blk_t *b = k ? p->live[k - 1] : NULL;
    if (!b || off + bytes > b->off + b->size || off + bytes < off) {
        pool_leave(p);
        return fail(UMP_ERR_ARG); /* not inside one live block */
    }
    /* A live block's granules are all backed (touch mapped them). */
    handle_t *first = &p->hs[p->main.gh[off / p->gran]];
    handle_t *last = &p->hs[p->main.gh[(off + bytes - 1) / p->gran]];
    uint64_t a0 = first->at, a1 = last->at + last->ngran;
    int v, pushed;
    status = view_begin(p, REGION_ALIAS, a1 - a0, 0, &v, &pushed);
    for (uint64_t g = a0; g < a1 && status == UMP_OK;) {
        int64_t i = p->main.gh[g];
        status = view_map(p, v, g - a0, i);
        g += p->hs[i].ngran;
    }
    status = view_end(p, v, status, pushed);
    if (status == UMP_OK)
        *alias = p->bufs[v].va + (off - a0 * p->gran);
    pool_leave(p);
    return view_made(v, status, view);
}

/* One handle of `bytes` (whole granules) mapped at va and again at
 * va + bytes: byte i and byte i + bytes are the same memory. */
int ump_vmm_ring_create(int id, uint64_t bytes, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES / 2)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    if (bytes % p->gran) {
        pool_leave(p);
        return fail(UMP_ERR_ARG);
    }
    uint64_t n = bytes / p->gran;
    int v, pushed;
    int64_t i;
    status = view_begin(p, REGION_RING, 2 * n, bytes, &v, &pushed);
    if (status == UMP_OK)
        status = view_handle(p, v, n, p->device, 0, &i);
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    if (status == UMP_OK)
        status = view_map(p, v, n, i);
    status = view_end(p, v, status, pushed);
    pool_leave(p);
    return view_made(v, status, view);
}

/* Granule g on devices[g % ndevices], every device of the pool given access
 * to all of it. The devices must have been granted access to the pool. */
int ump_vmm_striped_create(int id, uint64_t bytes, const int *devices, int ndevices, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES || !devices || ndevices < 1 ||
        ndevices > MAX_DEVICES)
        return fail(UMP_ERR_ARG);
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    for (int d = 0; d < ndevices; d++) {
        int granted = 0;
        for (int k = 0; k < p->ndev; k++)
            granted |= p->devs[k] == devices[d];
        if (!granted)
            status = UMP_ERR_ARG;
    }
    if (status != UMP_OK) {
        pool_leave(p);
        return fail(status); /* grant them access first */
    }
    int v, pushed;
    status = view_begin(p, REGION_STRIPED, granules(p, bytes), granules(p, bytes) * p->gran, &v, &pushed);
    for (uint64_t g = 0; status == UMP_OK && g < p->bufs[v].ngran; g++) {
        int64_t i;
        status = view_handle(p, v, 1, devices[g % (uint64_t)ndevices], 0, &i);
        if (status == UMP_OK)
            status = view_map(p, v, g, i);
    }
    status = view_end(p, v, status, pushed);
    pool_leave(p);
    return view_made(v, status, view);
}

int ump_vmm_view_info(int id, int view, uintptr_t *ptr, uint64_t *size, ump_vmm_view_times_t *times)
{
    return region_info(id, view_get, view, ptr, size, times);
}

int ump_vmm_view_destroy(int id, int view)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    status = view_get(p, view) ? ph_sync(p) : UMP_ERR_ARG;
    if (status == UMP_OK) {
        int pushed;
        ph_enter(p, &pushed);
        view_close(p, view);
        ph_leave(p, pushed);
    }
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
}

/* --- lookup (for ump_lookup, lookup.c) ------------------------------------ */

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
        int region, found = 0;
        region_t *r = p->closing ? NULL : region_at(p, ptr, &region);
        if (r && region == 0) {
            size_t i = live_find(p, ptr - r->va + 1);
            if (i > 0) {
                blk_t *b = p->live[i - 1];
                if (ptr < r->va + b->off + b->size) {
                    *base = r->va + b->off;
                    *size = b->size;
                    found = 1;
                }
            }
        } else if (r && ptr < r->va + r->size) {
            *base = r->va;
            *size = r->size;
            found = 1;
        }
        if (found) {
            kind = p->provider == UMP_PROVIDER_HOST ? UMP_KIND_HOST : UMP_KIND_DEVICE;
            *pool = pool_id(p); /* pinned: its generation holds */
        }
        pool_leave(p);
    }
    return kind;
}

/* Give everything back: only when no block or buffer is live. Destroy
 * pins the pool like any call, so it never holds pools_lock while it waits
 * for the pool's lock, and the slot goes with the last pin (pool ids). */
int ump_vmm_destroy(int id)
{
    pool_t *p;
    int status = pool_enter(id, &p);
    if (status != UMP_OK)
        return fail(status);
    for (int b = 0; b < p->nbufs; b++)
        if (p->bufs[b].live)
            status = UMP_ERR_ARG;
    if (p->nlive)
        status = UMP_ERR_ARG;
    int pushed = 0;
    if (status == UMP_OK)
        status = ph_enter(p, &pushed);
    if (status == UMP_OK)
        status = ph_sync(p);
    if (status == UMP_OK) {
        for (size_t i = 0; i < p->nh; i++)
            if (p->hs[i].ngran && p->hs[i].region >= 0)
                handle_unmap(p, (int64_t)i);
        release_cached(p, 0);
        ph_unreserve(p, p->main.va, p->main.ngran * p->gran);
        blk_t *b = p->last;
        while (b) {
            blk_t *q = b->prev;
            free(b);
            b = q;
        }
        free(p->sb);
        free(p->live);
        free(p->hs);
        free(p->gref);
        free(p->main.gh);
        free(p->bufs);
        __atomic_store_n(&p->closing, 1, __ATOMIC_RELAXED);
    }
    ph_leave(p, pushed);
    pool_leave(p);
    return status == UMP_OK ? UMP_OK : fail(status);
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
            p->inherited = 1;
        }
    }
    pthread_mutex_init(&pools_lock, NULL);
}

__attribute__((constructor)) static void vmm_init(void)
{
    ump__on_fork(UMP_FORK_POOLS, fork_prepare, fork_parent, fork_child);
}
