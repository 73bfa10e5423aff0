/*
 * ump.h - the C core of ump: aligned allocation hooks for NumPy (NEP 49),
 * size-class arenas over large chunks, and the registry that answers
 * "is this pointer ours, which kind, which block".
 *
 * Every function here is callable without the GIL and from any thread.
 * None of them raises. A function that makes something returns a status
 * (UMP_OK, one of ump's UMP_ERR_*, or a CUresult) and writes the new id
 * through an out-pointer, so an id is never mistaken for a status; the hooks
 * and ump_vmm_alloc return NULL / 0 on failure. Every failure also leaves the
 * status where ump_last_status() reads it.
 */
#ifndef UMP_H
#define UMP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the functions' signatures, which ump/_core.py declares by
 * hand; bump it when one changes. Constants and struct layouts need no
 * version: the extension module exports them (module.c) and the Python layer
 * builds its mirrors from what it exports. */
#define UMP_ABI_VERSION 8

/* CuPy's kernels and memory pool work in 512-byte units, so every block is
 * aligned to 512 bytes and its size rounded up to a multiple of 512. */
#define UMP_ALIGN 512u

/* The kinds, providers and arena flags below, like the status codes, are
 * each one X-macro list, which gives the C declarations and what the
 * extension exports (module.c): a new one is written in one place. */

/* Kinds of memory, as reported by ump_lookup(), in order of value, each with
 * the name Python gives it (ump.kind_of, Options.kind). */
#define UMP_KINDS(X)                                                              \
    X(UMP_KIND_HOST, 1, "host")       /* host memory, no GPU in the process */    \
    X(UMP_KIND_SYSTEM, 2, "system")   /* host memory on a SAM (HMM/ATS) system */ \
    X(UMP_KIND_MANAGED, 3, "managed") /* cuMemAllocManaged */                     \
    X(UMP_KIND_PINNED, 4, "pinned")   /* host memory, registered and mapped */    \
    X(UMP_KIND_DEVICE, 5, "device")   /* device-only memory (VMM pool) */

enum ump_kind {
    UMP_KIND_NONE = 0, /* not a live ump block */
#define UMP_KIND_ENUM(name, value, label) name = (value),
    UMP_KINDS(UMP_KIND_ENUM)
#undef UMP_KIND_ENUM
    UMP_KIND_END       /* one past the last kind: the size of a table by kind */
};

/* Where an arena takes its chunks from, or a pool its physical memory. */
#define UMP_PROVIDERS(X)                                                          \
    X(UMP_PROVIDER_HOST, 0)    /* anonymous mmap */                               \
    X(UMP_PROVIDER_MANAGED, 1) /* cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL) */      \
    X(UMP_PROVIDER_PINNED, 2)  /* mmap + cuMemHostRegister(DEVICEMAP) */          \
    X(UMP_PROVIDER_DEVICE, 3)  /* VMM pools: cuMemCreate + cuMemMap */

enum ump_provider {
#define UMP_PROVIDER_ENUM(name, value) name = (value),
    UMP_PROVIDERS(UMP_PROVIDER_ENUM)
#undef UMP_PROVIDER_ENUM
};

/* Flags of an arena (bits); arenas with the same kind, provider and flags
 * are one. */
#define UMP_ARENA_FLAGS(X)                                                        \
    X(UMP_ARENA_ADVISE_HOST, 1) /* managed chunks advised to stay on the host */  \
    X(UMP_ARENA_CUPY, 2)        /* CuPy's side: its own blocks and statistics */

enum ump_arena_flag {
#define UMP_ARENA_FLAG_ENUM(name, value) name = (value),
    UMP_ARENA_FLAGS(UMP_ARENA_FLAG_ENUM)
#undef UMP_ARENA_FLAG_ENUM
};

/* Status codes beyond CUDA's own CUresult values (which are >= 0). One list
 * gives the constants, their names (ump_cuda_error_name) and the extension's
 * attributes. */
#define UMP_OK 0
#define UMP_ERRORS(X)                                                             \
    X(UMP_ERR_NOMEM, -1)       /* the OS or the provider is out of memory */      \
    X(UMP_ERR_CAP, -2)         /* the arena's cap would be exceeded */            \
    X(UMP_ERR_NOCUDA, -3)      /* libcuda.so.1 is not loaded */                   \
    X(UMP_ERR_FORKED, -4)      /* a child after fork() must not call CUDA */      \
    X(UMP_ERR_ARG, -5)         /* a bad argument (size, arena id, ...) */         \
    X(UMP_ERR_INJECTED, -6)    /* failure injected by ump_fault_inject() */       \
    X(UMP_ERR_HANDLE, -7)      /* not ump's handle, or not the one described */   \
    X(UMP_ERR_UNSUPPORTED, -8) /* the driver cannot share physical memory */    \
    X(UMP_ERR_OS, -9)          /* an OS call failed: ump_last_os_error() */       \
    X(UMP_ERR_RANGE, -10)      /* a pool's reserved address range is full */

enum ump_error {
#define UMP_ERROR_ENUM(name, value) name = (value),
    UMP_ERRORS(UMP_ERROR_ENUM)
#undef UMP_ERROR_ENUM
};

/* Arenas: two per backend enabled in the process, and one per other GPU
 * CuPy allocates on (csrc/arena.c). */
#define UMP_MAX_ARENAS 64
#define UMP_MAX_POOLS 16
/* The smallest chunk an arena takes from its provider: a cap below it fits
 * no chunk, and every block would go to plain memory. */
#define UMP_CHUNK_MIN ((uint64_t)2 << 20)
/* The most bytes one VMM buffer, view or import may span (128 TiB, the
 * user address space of x86-64): a larger size is a bad argument. */
#define UMP_VMM_MAX_BYTES ((uint64_t)1 << 47)
/* The most address space a pool reserves for its blocks. */
#define UMP_VMM_MAX_RESERVE ((uint64_t)1 << 48)
/* Devices a pool may grant access to (cuMemSetAccess takes them at once). */
#define UMP_VMM_MAX_DEVICES 16

/* The statistics structs are lists of uint64_t fields, each written once:
 * the typedef and the extension's field names (module.c) come from the list,
 * so the Python mirror is checked against it, never copied from it. */
#define UMP_U64_FIELD(name) uint64_t name;

/* An arena's statistics (ump_arena_stats, ump_fallback_stats). */
#define UMP_STATS_FIELDS(X)                                                       \
    X(current_bytes) X(peak_bytes) X(total_bytes)                                 \
    X(current_count) X(peak_count) X(total_count)                                 \
    X(held_bytes)   /* taken from the provider (live + cached) */                 \
    X(cached_bytes) /* held but wholly free (empty slabs, free runs) */           \
    X(cap_bytes)                                                                  \
    X(chunk_allocs) /* provider calls that succeeded */                           \
    X(chunk_frees)                                                                \
    X(failures)     /* allocations refused (cap, provider error) */

typedef struct { UMP_STATS_FIELDS(UMP_U64_FIELD) } ump_stats_t;

/* --- NumPy hooks (NEP 49, through numpy_allocator) ---------------------- */
void *ump_malloc(size_t size);
void *ump_calloc(size_t nmemb, size_t size);
void *ump_realloc(void *ptr, size_t size);
void ump_free(void *ptr, size_t size);

/* The arena that ump_malloc serves from; -1 serves plain aligned memory. */
int ump_set_numpy_arena(int arena);
int ump_get_numpy_arena(void);

/* --- arenas -------------------------------------------------------------- */
/* flags: UMP_ARENA_FLAGS. Arenas of one kind and one `device` share one
 * budget (cap_bytes: its cap); device -1 is the backend's main budget, a
 * device index a budget of that GPU's own (memory that lives on it). ctx:
 * the CUDA context chunks are made and freed under (0: ump's), which is
 * the device cudaPointerGetAttributes names for them. */
int ump_arena_create(int kind, int provider, uint64_t cap_bytes, int flags, int device,
                     uintptr_t ctx, int *arena);
int ump_arena_set_cap(int arena, uint64_t cap_bytes);
void *ump_arena_alloc(int arena, size_t size);
int ump_arena_free(void *ptr);
int ump_arena_trim(int arena);
int ump_arena_stats(int arena, ump_stats_t *out);
int ump_fallback_stats(ump_stats_t *out);

/* --- VMM device pools (pool.c, and the units pools.h lists) --------------- */
/* A pool's statistics (ump_vmm_stats). */
#define UMP_VMM_STATS_FIELDS(X)                                                   \
    X(used_bytes) X(peak_used_bytes) X(total_bytes) /* blocks handed out */       \
    X(current_count) X(peak_count) X(total_count)                                 \
    X(buffer_bytes)        /* growable buffers, in use */                         \
    X(reserved_bytes)      /* address space reserved */                           \
    X(mapped_bytes) X(peak_mapped_bytes)                                          \
    X(physical_bytes) X(peak_physical_bytes) /* handles held: mapped + cached */  \
    X(cached_bytes)        /* handles held but not mapped */                      \
    X(idle_bytes)          /* mapped, touched by no live block */                 \
    X(limit_bytes) X(granularity)                                                 \
    X(handles) X(handles_created) X(handles_released) X(maps) X(unmaps)           \
    X(rollbacks) X(migrations) X(failures) X(bad_frees)                           \
    X(view_bytes)          /* address space mapped by views */                    \
    X(shared_bytes)        /* handles views own (in physical_bytes) */            \
    X(imported_bytes)      /* other processes' memory mapped here */              \
    X(views) X(exports)    /* live views; handles exported so far */        \
    X(stream_bins)         /* streams that hold free blocks */

typedef struct { UMP_VMM_STATS_FIELDS(UMP_U64_FIELD) } ump_vmm_stats_t;

/* How long each step of making a view took (ump_vmm_view_info), in
 * nanoseconds summed over the step's calls: what importing, mapping and
 * granting access to shared memory cost, apart. */
#define UMP_VMM_VIEW_TIMES_FIELDS(X)                                              \
    X(reserve_ns)  /* its address range (cuMemAddressReserve) */                  \
    X(physical_ns) /* cuMemCreate; imported: cuMemImportFromShareableHandle */    \
    X(map_ns)      /* cuMemMap, every mapping */                                  \
    X(access_ns)   /* cuMemSetAccess */

typedef struct { UMP_VMM_VIEW_TIMES_FIELDS(UMP_U64_FIELD) } ump_vmm_view_times_t;

/* What a view is (ump_vmm_view_info), with the name Python gives it
 * (MappedMemory.kind). Values follow the pool's own regions (its main range
 * 0, buffers 1). */
#define UMP_VIEW_KINDS(X)                                                         \
    X(UMP_VIEW_SHARED, 2, "shared")     /* exportable memory of its own */        \
    X(UMP_VIEW_IMPORTED, 3, "imported") /* another process's memory */            \
    X(UMP_VIEW_ALIAS, 4, "alias")       /* a live block's memory, again */        \
    X(UMP_VIEW_RING, 5, "ring")         /* one handle mapped twice */             \
    X(UMP_VIEW_STRIPED, 6, "striped")   /* granules over several devices */

enum ump_view_kind {
#define UMP_VIEW_KIND_ENUM(name, value, label) name = (value),
    UMP_VIEW_KINDS(UMP_VIEW_KIND_ENUM)
#undef UMP_VIEW_KIND_ENUM
};

/* provider: UMP_PROVIDER_DEVICE, or UMP_PROVIDER_HOST for the same pool on an
 * emulated physical layer (memfd) that runs without a GPU. ctx: the device's
 * primary context. limit 0: none. Writes the pool's id to *pool. At most
 * UMP_MAX_POOLS pools exist at once; an id is never handed out again for
 * about a million pools made in the same slot after it. */
int ump_vmm_create(int provider, int device, uintptr_t ctx, uint64_t va_bytes, uint64_t limit,
                   int *pool);
/* Only when no block, buffer or view is live. Every later call with the id
 * fails with UMP_ERR_HANDLE. */
int ump_vmm_destroy(int pool);
uintptr_t ump_vmm_alloc(int pool, uint64_t size, uintptr_t stream);
int ump_vmm_free(int pool, uintptr_t ptr);
int ump_vmm_trim(int pool, int keep_handles);
int ump_vmm_set_limit(int pool, uint64_t limit);
int ump_vmm_stats(int pool, ump_vmm_stats_t *out);
int ump_vmm_grant(int pool, int device);
/* The devices granted access (at most `max` of them written); *n: how many. */
int ump_vmm_devices(int pool, int *out, int max, int *n);
int ump_vmm_migrate(int pool, uintptr_t ptr, uint64_t bytes, int device);
/* The device each byte of [ptr, ptr+bytes) lives on, or -1 if mixed. */
int ump_vmm_device_of(int pool, uintptr_t ptr, uint64_t bytes, int *device);
int ump_vmm_buffer_create(int pool, uint64_t max_bytes, int *buf);
int ump_vmm_buffer_destroy(int pool, int buf);
int ump_vmm_buffer_resize(int pool, int buf, uint64_t bytes);
int ump_vmm_buffer_info(int pool, int buf, uintptr_t *ptr, uint64_t *size);

/* Views: address ranges of their own over physical memory, each with its own
 * reservation. Each writes the new view's id to *view. */
int ump_vmm_shared_create(int pool, uint64_t bytes, int *view); /* exportable memory */
int ump_vmm_export(int pool, int view, int *fd);                  /* a new fd the caller owns */
/* Another process's memory: `fd` (which stays the caller's) is checked to be
 * the exportable memory of `bytes` it claims to be before anything is
 * reserved for it. */
int ump_vmm_import(int pool, int fd, uint64_t bytes, int device, int *view);
int ump_vmm_alias_create(int pool, uintptr_t ptr, uint64_t bytes, uintptr_t *alias, int *view);
int ump_vmm_ring_create(int pool, uint64_t bytes, int *view); /* mapped twice, back to back */
int ump_vmm_striped_create(int pool, uint64_t bytes, const int *devices, int ndevices, int *view);
/* Its address, bytes mapped and, where not NULL, its kind (UMP_VIEW_*) and
 * set-up times. */
int ump_vmm_view_info(int pool, int view, uintptr_t *ptr, uint64_t *size, int *kind,
                      ump_vmm_view_times_t *times);
int ump_vmm_view_destroy(int pool, int view);

/* --- registry ------------------------------------------------------------ */
/* Kind of the live block holding ptr (UMP_KIND_NONE if none), in an arena or
 * a VMM pool (whose ids follow the arenas': UMP_MAX_ARENAS + pool);
 * base/size/arena may be NULL. O(log chunks), then O(log blocks) per pool. */
int ump_lookup(uintptr_t ptr, uintptr_t *base, uint64_t *size, int *arena);
uint64_t ump_foreign_frees(void);

/* --- CUDA ---------------------------------------------------------------- */
/* Open the driver (NULL: libcuda.so.1); UMP_ERR_NOCUDA where there is none. */
int ump_cuda_load(const char *path);
int ump_cuda_set_context(uintptr_t ctx, int device);

/* --- devices (device.c): what ump reads of the GPUs, and their contexts --- */
/* cuInit, then the driver's version and how many devices it has. Needs no
 * CUDA context and makes none. */
int ump_cuda_init(int *driver_version, int *count);

/* What ump reads of a device (ump_device_probe): attributes
 * (cuDeviceGetAttribute, each 0 or a number), its memory, and its VMM
 * granularities (0 without VMM). */
#define UMP_DEVICE_FIELDS(X)                                                      \
    X(compute_capability_major) X(compute_capability_minor)                       \
    X(total_memory)                                                               \
    X(managed_memory)                                                             \
    X(pageable_memory_access)          /* SAM: HMM or ATS */                      \
    X(uses_host_page_tables)           /* SAM through the host's tables: ATS */   \
    X(concurrent_managed_access)                                                  \
    X(host_pointer_for_registered_mem) /* registered memory keeps its address */ \
    X(vmm_supported)                                                              \
    X(vmm_granularity) X(vmm_recommended_granularity)                             \
    X(posix_fd_handles)                /* VMM memory exports as a file descriptor */

typedef struct { UMP_DEVICE_FIELDS(UMP_U64_FIELD) } ump_device_t;

/* The device's fields and its name (at most len - 1 bytes, NUL-terminated). */
int ump_device_probe(int device, ump_device_t *out, char *name, size_t len);
/* Retain the device's primary context (CuPy's and the runtime's too) and
 * write it to *ctx; ump_device_release lets go of one retain. */
int ump_device_retain(int device, uintptr_t *ctx);
int ump_device_release(int device);
/* Free and total memory of the device whose context ctx is. */
int ump_device_memory(uintptr_t ctx, uint64_t *free_bytes, uint64_t *total_bytes);
int ump_device_can_access_peer(int device, int peer, int *can);
/* Whether the device's primary context is active: only then can work of
 * this process be queued on the device. */
int ump_device_active(int device, int *active);
/* Make ctx current on this thread for a few driver calls made elsewhere
 * (cuda-bindings), then pop it. */
int ump_context_push(uintptr_t ctx);
int ump_context_pop(void);
int ump_prefetch(uintptr_t ptr, uint64_t size, int device, uintptr_t stream);
int ump_advise(uintptr_t ptr, uint64_t size, int advice, int device);
int ump_cuda_error_name(int status, char *buf, size_t len);

/* --- diagnostics --------------------------------------------------------- */
int ump_last_status(void);
/* The errno behind this thread's last UMP_ERR_OS (EMFILE, ...). */
int ump_last_os_error(void);
/* Fail provider calls: skip `after` successful ones, then fail `count`
 * (-1: all). ump_fault_inject(0, 0) turns injection off and the status back
 * to UMP_ERR_INJECTED. */
void ump_fault_inject(int64_t after, int64_t count);
/* The status an injected failure returns (UMP_ERR_INJECTED unless set):
 * a CUresult stands in for the driver's answer. */
void ump_fault_status(int status);
/* Sleep `usec` at every fault-injection point, which in a VMM pool lies
 * under the pool's lock: tests hold a lock open with it. 0: no delay. */
void ump_fault_delay(uint32_t usec);
/* Write one byte to fd (a pipe's write end) at the next fault-injection
 * point reached, then forget fd: a test learns that a call got there, under
 * whatever lock it holds at that point. -1: none. */
void ump_fault_signal(int fd);
int ump_is_forked_child(void);

#ifdef __cplusplus
}
#endif
#endif
