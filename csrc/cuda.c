/*
 * cuda.c - chunk providers and the few CUDA driver calls the C core makes.
 *
 * libcuda.so.1 is opened at run time (ump_cuda_load), so the package builds
 * with a plain C compiler and imports on machines without a GPU. The driver
 * API is used rather than the runtime: it needs no libcudart and lets us make
 * the primary context current in threads that have none (a NumPy allocation
 * can happen on any thread).
 */
#define _GNU_SOURCE
#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

/* One table for every unit: its entries are written under load_lock before
 * `lib` is published, and never change after. */
ump__driver_t ump__cu;

/* ump's context and device: set by enable() while other threads may be in
 * a provider call that reads them, hence atomic. Each reader loads one of
 * them once; none needs the pair to match. */
static CUcontext ump_ctx;
static int ump_device;

static CUcontext own_ctx(void) { return __atomic_load_n(&ump_ctx, __ATOMIC_ACQUIRE); }
static int own_device(void) { return __atomic_load_n(&ump_device, __ATOMIC_ACQUIRE); }
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

#define LOAD(field, name) (*(void **)&ump__cu.field = dlsym(lib, name))

int ump_cuda_load(const char *path)
{
    pthread_mutex_lock(&load_lock);
    if (ump__cu.lib) {
        pthread_mutex_unlock(&load_lock);
        return UMP_OK;
    }
    void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        pthread_mutex_unlock(&load_lock);
        return ump__set_status(UMP_ERR_NOCUDA);
    }
    LOAD(memAllocManaged, "cuMemAllocManaged");
    LOAD(memFree, "cuMemFree_v2");
    LOAD(memHostRegister, "cuMemHostRegister_v2");
    LOAD(memHostUnregister, "cuMemHostUnregister");
    LOAD(ctxGetCurrent, "cuCtxGetCurrent");
    LOAD(ctxPushCurrent, "cuCtxPushCurrent_v2");
    LOAD(ctxPopCurrent, "cuCtxPopCurrent_v2");
    LOAD(getErrorName, "cuGetErrorName");
    LOAD(prefetch_v2, "cuMemPrefetchAsync_v2");
    LOAD(advise_v2, "cuMemAdvise_v2");
    if (!ump__cu.prefetch_v2)
        LOAD(prefetch_v1, "cuMemPrefetchAsync");
    if (!ump__cu.advise_v2)
        LOAD(advise_v1, "cuMemAdvise");
    LOAD(memAddressReserve, "cuMemAddressReserve");
    LOAD(memAddressFree, "cuMemAddressFree");
    LOAD(memCreate, "cuMemCreate");
    LOAD(memRelease, "cuMemRelease");
    LOAD(memMap, "cuMemMap");
    LOAD(memUnmap, "cuMemUnmap");
    LOAD(memSetAccess, "cuMemSetAccess");
    LOAD(memGetAllocationGranularity, "cuMemGetAllocationGranularity");
    LOAD(ctxSynchronize, "cuCtxSynchronize");
    LOAD(memcpyDtoD, "cuMemcpyDtoD_v2");
    LOAD(deviceGet, "cuDeviceGet");
    LOAD(primaryCtxGetState, "cuDevicePrimaryCtxGetState");
    LOAD(primaryCtxRetain, "cuDevicePrimaryCtxRetain");
    LOAD(primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    LOAD(memExportToShareableHandle, "cuMemExportToShareableHandle");
    LOAD(memImportFromShareableHandle, "cuMemImportFromShareableHandle");
    LOAD(memGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    ump__cu.share = ump__cu.memExportToShareableHandle && ump__cu.memImportFromShareableHandle &&
                    ump__cu.memGetAllocationPropertiesFromHandle;
    ump__cu.vmm = ump__cu.memAddressReserve && ump__cu.memAddressFree && ump__cu.memCreate &&
                  ump__cu.memRelease && ump__cu.memMap && ump__cu.memUnmap &&
                  ump__cu.memSetAccess && ump__cu.memGetAllocationGranularity &&
                  ump__cu.ctxSynchronize && ump__cu.memcpyDtoD;
    if (!ump__cu.memAllocManaged || !ump__cu.memFree || !ump__cu.memHostRegister ||
        !ump__cu.memHostUnregister || !ump__cu.ctxGetCurrent || !ump__cu.ctxPushCurrent ||
        !ump__cu.ctxPopCurrent || !ump__cu.getErrorName) {
        memset(&ump__cu, 0, sizeof ump__cu);
        dlclose(lib);
        pthread_mutex_unlock(&load_lock);
        return ump__set_status(UMP_ERR_NOCUDA);
    }
    __atomic_store_n(&ump__cu.lib, lib, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&load_lock);
    return UMP_OK;
}

static void fork_prepare(void) { pthread_mutex_lock(&load_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&load_lock); }
static void fork_child(void) { pthread_mutex_init(&load_lock, NULL); }

__attribute__((constructor)) static void cuda_init(void)
{
    ump__on_fork(UMP_FORK_CUDA, fork_prepare, fork_parent, fork_child);
}

int ump_cuda_set_context(uintptr_t ctx, int device)
{
    if (device < 0)
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&ump_device, device, __ATOMIC_RELEASE);
    __atomic_store_n(&ump_ctx, (CUcontext)ctx, __ATOMIC_RELEASE);
    return UMP_OK;
}

/* The CUresults the core itself acts on, named without the driver: a
 * status injected in their place (ump_fault_status) on a machine without
 * a GPU reads as the driver's own would. */
static const char *known_cuda_error(int status)
{
    switch (status) {
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    default: return NULL;
    }
}

int ump_cuda_error_name(int status, char *buf, size_t len)
{
    const char *name = ump__status_name(status);
    void *lib = __atomic_load_n(&ump__cu.lib, __ATOMIC_ACQUIRE);
    if (!name && lib && ump__cu.getErrorName(status, &name) != CUDA_SUCCESS)
        name = NULL;
    if (!name)
        name = known_cuda_error(status);
    if (!name)
        name = "CUDA_ERROR_UNKNOWN";
    if (buf && len) {
        strncpy(buf, name, len - 1);
        buf[len - 1] = 0;
    }
    return UMP_OK;
}

int ump__ctx_enter(void *ctx)
{
    CUcontext cur = NULL;
    int has = ump__cu.ctxGetCurrent(&cur) == CUDA_SUCCESS && cur;
    if (!ctx) {
        if (has)
            return 0;
        ctx = own_ctx();
    }
    if (!ctx || (has && cur == ctx))
        return 0;
    return ump__cu.ctxPushCurrent(ctx) == CUDA_SUCCESS;
}

void ump__ctx_leave(int pushed)
{
    CUcontext dummy;
    if (pushed)
        ump__cu.ctxPopCurrent(&dummy);
}

int ump__cuda_ready(void)
{
    if (ump__forked)
        return UMP_ERR_FORKED;
    return __atomic_load_n(&ump__cu.lib, __ATOMIC_ACQUIRE) ? UMP_OK : UMP_ERR_NOCUDA;
}

static void *map_host(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

int ump__provider_alloc(int provider, size_t size, void **out, int *fresh_zero, void *ctx)
{
    *out = NULL;
    *fresh_zero = 0;
    if (provider == UMP_PROVIDER_HOST) {
        *out = map_host(size);
        *fresh_zero = 1;
        return *out ? UMP_OK : UMP_ERR_NOMEM;
    }
    int status = ump__cuda_ready();
    if (status != UMP_OK)
        return status;
    /* Memory is allocated (managed) or registered (pinned) under the
     * arena's context (ump's unless the arena serves another device), not
     * the caller's: cudaPointerGetAttributes names the device whose context
     * made it, and libraries that take a pointer (PyTorch's as_tensor) copy
     * when that is not the device they were asked for. Otherwise a chunk
     * made while another device was current would name that device for
     * every array later carved from it. Managed memory is reachable from
     * every device, registered memory is PORTABLE. */
    int pushed = ump__ctx_enter(ctx ? ctx : own_ctx());
    if (provider == UMP_PROVIDER_MANAGED) {
        CUdeviceptr d = 0;
        status = ump__cu.memAllocManaged(&d, size, CU_MEM_ATTACH_GLOBAL);
        *out = (void *)d;
    } else {
        /* The system path plus registration: with
         * canUseHostPointerForRegisteredMem = 1 the device pointer of
         * registered memory is its host pointer, so no translation. */
        void *p = map_host(size);
        if (!p) {
            status = UMP_ERR_NOMEM;
        } else {
            status = ump__cu.memHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE |
                                                      CU_MEMHOSTREGISTER_DEVICEMAP);
            if (status != CUDA_SUCCESS)
                munmap(p, size);
            else
                *out = p;
        }
        *fresh_zero = status == CUDA_SUCCESS;
    }
    ump__ctx_leave(pushed);
    return status;
}

int ump__provider_free(int provider, void *ptr, size_t size, void *ctx)
{
    if (provider == UMP_PROVIDER_HOST)
        return munmap(ptr, size) == 0 ? UMP_OK : UMP_ERR_ARG;
    int status = ump__cuda_ready();
    if (status != UMP_OK)
        return status; /* after fork: leak rather than call CUDA */
    int pushed = ump__ctx_enter(ctx ? ctx : own_ctx()); /* the context that made it */
    if (provider == UMP_PROVIDER_MANAGED) {
        /* cuMemFree synchronises the device, so no kernel still uses it. */
        status = ump__cu.memFree((CUdeviceptr)ptr);
    } else {
        status = ump__cu.memHostUnregister(ptr);
        /* Still registered: unmapping would let a later mmap at this
         * address fail to register. Leak it instead. */
        if (status == CUDA_SUCCESS)
            munmap(ptr, size);
    }
    ump__ctx_leave(pushed);
    return status;
}

static CUmemLocation location(int device)
{
    CUmemLocation loc;
    loc.type = device < 0 ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = device < 0 ? 0 : device;
    return loc;
}

static int advise(uintptr_t ptr, uint64_t size, int advice, int device)
{
    if (ump__cu.advise_v2)
        return ump__cu.advise_v2(ptr, size, advice, location(device));
    if (ump__cu.advise_v1)
        return ump__cu.advise_v1(ptr, size, advice, device < 0 ? CU_DEVICE_CPU : device);
    return UMP_ERR_NOCUDA;
}

void ump__advise_host(void *ptr, size_t size)
{
    if (ump__cuda_ready() != UMP_OK)
        return;
    int pushed = ump__ctx_enter(NULL);
    /* Pages stay in host memory and the GPU maps them over the link: for data
     * the GPU touches once this beats any migration (see docs/backends.md). */
    advise((uintptr_t)ptr, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, -1);
    advise((uintptr_t)ptr, size, CU_MEM_ADVISE_SET_ACCESSED_BY, own_device());
    ump__ctx_leave(pushed);
}

static int prefetch(uintptr_t ptr, uint64_t size, int device, CUstream stream)
{
    if (ump__cu.prefetch_v2)
        return ump__cu.prefetch_v2(ptr, size, location(device), 0, stream);
    if (ump__cu.prefetch_v1)
        return ump__cu.prefetch_v1(ptr, size, device < 0 ? CU_DEVICE_CPU : device, stream);
    return UMP_ERR_NOCUDA;
}

void ump__populate_gpu(void *ptr, size_t size, int device, void *ctx)
{
    if (ump__cuda_ready() != UMP_OK)
        return;
    int pushed = ump__ctx_enter(ctx);
    /* A new chunk has no pages yet, and CuPy's kernels write it first: pages
     * made by a prefetch cost what an allocation does, where each made by
     * the first kernel's faults costs a fault (an elementwise chain over
     * fresh 80 MB arrays ran twice as long). Stream 0: nothing uses the
     * chunk yet; a failure leaves the pages to the faults. */
    prefetch((uintptr_t)ptr, size, device < 0 ? ump_device : device, NULL);
    ump__ctx_leave(pushed);
}

int ump_advise(uintptr_t ptr, uint64_t size, int advice, int device)
{
    int status = ump__cuda_ready();
    if (status != UMP_OK)
        return ump__set_status(status);
    int pushed = ump__ctx_enter(NULL);
    status = advise(ptr, size, advice, device);
    ump__ctx_leave(pushed);
    return status ? ump__set_status(status) : UMP_OK;
}

int ump_prefetch(uintptr_t ptr, uint64_t size, int device, uintptr_t stream)
{
    int status = ump__cuda_ready();
    if (status != UMP_OK)
        return ump__set_status(status);
    int pushed = ump__ctx_enter(NULL);
    status = prefetch(ptr, size, device, (CUstream)stream);
    ump__ctx_leave(pushed);
    return status ? ump__set_status(status) : UMP_OK;
}
