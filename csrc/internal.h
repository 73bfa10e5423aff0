/* internal.h - what the units of the C core share; not part of the public API. */
#ifndef UMP_INTERNAL_H
#define UMP_INTERNAL_H

#include "cudadrv.h"
#include "ump.h"

#define UMP_HIDDEN __attribute__((visibility("hidden")))

/* --- common.c: status, fault injection, fork ----------------------------- */

/* Record a status for ump_last_status(); returns it. */
UMP_HIDDEN int ump__set_status(int status);
/* The name of one of ump's own statuses (UMP_ERR_*), NULL for any other. */
UMP_HIDDEN const char *ump__status_name(int status);

/* The status of a failed OS call with errno `err`: UMP_ERR_NOMEM for
 * ENOMEM, else UMP_ERR_OS, keeping `err` for ump_last_os_error(). */
UMP_HIDDEN int ump__os_status(int err);

/* Fault injection (ump_fault_inject): UMP_OK, or the status this provider
 * call must fail with (UMP_ERR_INJECTED, or what ump_fault_status set). */
UMP_HIDDEN int ump__injected_failure(void);

/* Set in a child after fork(): it must never call CUDA. */
UMP_HIDDEN extern volatile int ump__forked;

/* Each unit's locks, in the order fork's prepare takes them. A thread never
 * takes a lock of an earlier rank while it holds one of a later rank, or
 * prepare could wait on a thread that waits on prepare:
 *   UMP_FORK_CUDA      driver.c    the driver loader lock, never held with another
 *   UMP_FORK_TCACHE    tcache.c    the list of thread caches (a flush holds it
 *                                  with the arena's lock)
 *   UMP_FORK_REGISTRY  registry.c  the chunk registry (rwlock), held with an
 *                                  arena's lock by frees and trims
 *   UMP_FORK_ARENAS    arena.c     the arena list, then each arena; providers
 *                                  (CUDA) are called with none of the above held
 *   UMP_FORK_FALLBACK  fallback.c  the fallback set, never held with another
 *   UMP_FORK_POOLS     pool.c      the pool list, then each pool (held across
 *                                  cuCtxSynchronize); pools never call the arenas
 * ump_lookup asks the pools only after the arenas have let go of the registry. */
enum ump__fork_rank {
    UMP_FORK_CUDA,
    UMP_FORK_TCACHE,
    UMP_FORK_REGISTRY,
    UMP_FORK_ARENAS,
    UMP_FORK_FALLBACK,
    UMP_FORK_POOLS,
    UMP_FORK_RANKS
};

/* Register a unit's handlers (from its constructor). prepare takes every
 * lock of the unit, parent releases them, child re-initialises them. */
UMP_HIDDEN void ump__on_fork(enum ump__fork_rank rank, void (*prepare)(void),
                             void (*parent)(void), void (*child)(void));

/* --- driver.c: the driver's entry points, and contexts ----------------------
 * The bottom of the core: driver.c, device.c, provider.c and phys.c are the
 * only units that call the driver (through this table) or map memory. */

/* The driver's entry points, filled once by ump_cuda_load(); call them only
 * where ump__cuda_ready() says UMP_OK. `vmm`: the VMM entry points exist;
 * `devices`: the probe's. */
typedef struct {
    void *lib;
    int vmm, devices;
    CUresult (*memAllocManaged)(CUdeviceptr *, size_t, unsigned);
    CUresult (*memFree)(CUdeviceptr);
    CUresult (*memHostRegister)(void *, size_t, unsigned);
    CUresult (*memHostUnregister)(void *);
    CUresult (*ctxGetCurrent)(CUcontext *);
    CUresult (*ctxPushCurrent)(CUcontext);
    CUresult (*ctxPopCurrent)(CUcontext *);
    CUresult (*ctxSynchronize)(void);
    CUresult (*getErrorName)(CUresult, const char **);
    /* CUDA 12.2 added the CUmemLocation forms; CUDA 13 keeps only those
     * under the plain names, so prefer the _v2 symbols and fall back. */
    CUresult (*prefetch_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream);
    CUresult (*prefetch_v1)(CUdeviceptr, size_t, int, CUstream);
    CUresult (*advise_v2)(CUdeviceptr, size_t, int, CUmemLocation);
    CUresult (*advise_v1)(CUdeviceptr, size_t, int, int);
    CUresult (*memAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*memAddressFree)(CUdeviceptr, size_t);
    CUresult (*memCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
    CUresult (*memRelease)(CUmemGenericAllocationHandle);
    CUresult (*memMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*memUnmap)(CUdeviceptr, size_t);
    CUresult (*memSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*memGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*memcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
    /* Devices: the probe, primary contexts (the runtime's, CuPy's), peers. */
    CUresult (*init)(unsigned);
    CUresult (*driverGetVersion)(int *);
    CUresult (*deviceGetCount)(int *);
    CUresult (*deviceGet)(CUdevice *, int);
    CUresult (*deviceGetAttribute)(int *, int, CUdevice);
    CUresult (*deviceGetName)(char *, int, CUdevice);
    CUresult (*deviceTotalMem)(size_t *, CUdevice);
    CUresult (*deviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*memGetInfo)(size_t *, size_t *);
    CUresult (*primaryCtxGetState)(CUdevice, unsigned *, int *);
    CUresult (*primaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*primaryCtxRelease)(CUdevice);
    /* Sharing physical memory between processes (CUDA 10.2+): `share` says
     * all three exist. */
    int share;
    CUresult (*memExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
    CUresult (*memImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
    CUresult (*memGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
} ump__driver_t;

UMP_HIDDEN extern ump__driver_t ump__cu;

/* UMP_OK if CUDA may be called: loaded, and not in a forked child. */
UMP_HIDDEN int ump__cuda_ready(void);
/* Make a context current for a few driver calls: `ctx`, or for NULL any
 * context the thread has, else ump's (NumPy allocates on any thread, which
 * may have none). Returns whether one was pushed, for ump__ctx_leave(). */
UMP_HIDDEN int ump__ctx_enter(void *ctx);
UMP_HIDDEN void ump__ctx_leave(int pushed);
/* ump's context and device (ump_cuda_set_context), each read once. */
UMP_HIDDEN void *ump__own_ctx(void);
UMP_HIDDEN int ump__own_device(void);

/* --- device.c: devices and their primary contexts ------------------------ */

/* Wait for the work of `device`'s primary context (the runtime's, CuPy's).
 * One that is not active has no kernel left to wait for. */
UMP_HIDDEN int ump__device_sync(int device);

/* --- provider.c: chunks for the arenas ---------------------------------- */

/* Take `size` bytes (a multiple of the page size) from a provider. Returns
 * UMP_OK and *out, or a status. Called with no ump lock held: CUDA calls are
 * slow and may synchronise. `fresh_zero` is set when the memory is known to
 * be zero-filled. ctx: the CUDA context to work under (NULL: ump's). */
UMP_HIDDEN int ump__provider_alloc(int provider, size_t size, void **out, int *fresh_zero,
                                   void *ctx);
UMP_HIDDEN int ump__provider_free(int provider, void *ptr, size_t size, void *ctx);
/* Zero `size` bytes at `ptr`, reused memory of a provider's chunk; a large
 * block of anonymous host memory gives its whole pages back rather than
 * commit them all. */
UMP_HIDDEN void ump__provider_zero(int provider, void *ptr, size_t size);
/* Advise a new managed chunk to live on the host and be mapped by the GPU. */
UMP_HIDDEN void ump__advise_host(void *ptr, size_t size);

/* --- owners of memory, asked by ump_lookup() (lookup.c) ------------------ */

/* The kind of the live block holding ptr, with its base, size and owner's
 * id (outputs written only on a hit), or UMP_KIND_NONE. Each takes its own
 * locks and holds none on return. */
UMP_HIDDEN int ump__arena_lookup(uintptr_t ptr, uintptr_t *base, uint64_t *size, int *arena);
UMP_HIDDEN int ump__vmm_lookup(uintptr_t ptr, uintptr_t *base, uint64_t *size, int *pool);

#endif
