/*
 * driver.c - the CUDA driver's entry points, one table for every unit, and
 * the contexts driver calls run under.
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

/* One table for every unit: its entries are written under load_lock before
 * `lib` is published, and never change after. */
ump__driver_t ump__cu;

/* ump's context and device: set by enable() while other threads may be in
 * a provider call that reads them, hence atomic. Each reader loads one of
 * them once; none needs the pair to match. */
static CUcontext ump_ctx;
static int ump_device;

void *ump__own_ctx(void) { return __atomic_load_n(&ump_ctx, __ATOMIC_ACQUIRE); }
int ump__own_device(void) { return __atomic_load_n(&ump_device, __ATOMIC_ACQUIRE); }
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

#define LOAD(field, name) (*(void **)&ump__cu.field = dlsym(lib, name))

/* The entry points beyond those every provider needs: each group works, or
 * says it is missing, on its own. */
static void load_optional(void *lib)
{
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
    LOAD(init, "cuInit");
    LOAD(driverGetVersion, "cuDriverGetVersion");
    LOAD(deviceGetCount, "cuDeviceGetCount");
    LOAD(deviceGet, "cuDeviceGet");
    LOAD(deviceGetAttribute, "cuDeviceGetAttribute");
    LOAD(deviceGetName, "cuDeviceGetName");
    LOAD(deviceTotalMem, "cuDeviceTotalMem_v2");
    LOAD(deviceCanAccessPeer, "cuDeviceCanAccessPeer");
    LOAD(memGetInfo, "cuMemGetInfo_v2");
    LOAD(primaryCtxGetState, "cuDevicePrimaryCtxGetState");
    LOAD(primaryCtxRetain, "cuDevicePrimaryCtxRetain");
    LOAD(primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    LOAD(memExportToShareableHandle, "cuMemExportToShareableHandle");
    LOAD(memImportFromShareableHandle, "cuMemImportFromShareableHandle");
    LOAD(memGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    ump__driver_t *d = &ump__cu;
    d->share = d->memExportToShareableHandle && d->memImportFromShareableHandle &&
               d->memGetAllocationPropertiesFromHandle;
    d->vmm = d->memAddressReserve && d->memAddressFree && d->memCreate && d->memRelease &&
             d->memMap && d->memUnmap && d->memSetAccess && d->memGetAllocationGranularity &&
             d->ctxSynchronize && d->memcpyDtoD;
    d->devices = d->init && d->driverGetVersion && d->deviceGetCount && d->deviceGet &&
                 d->deviceGetAttribute && d->deviceGetName && d->deviceTotalMem &&
                 d->deviceCanAccessPeer && d->memGetInfo && d->primaryCtxGetState &&
                 d->primaryCtxRetain && d->primaryCtxRelease;
}

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
    load_optional(lib);
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

__attribute__((constructor)) static void driver_init(void)
{
    ump__on_fork(UMP_FORK_CUDA, fork_prepare, fork_parent, fork_child);
}

int ump__cuda_ready(void)
{
    if (ump__forked)
        return UMP_ERR_FORKED;
    return __atomic_load_n(&ump__cu.lib, __ATOMIC_ACQUIRE) ? UMP_OK : UMP_ERR_NOCUDA;
}

int ump_cuda_set_context(uintptr_t ctx, int device)
{
    if (device < 0)
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&ump_device, device, __ATOMIC_RELEASE);
    __atomic_store_n(&ump_ctx, (CUcontext)ctx, __ATOMIC_RELEASE);
    return UMP_OK;
}

int ump__ctx_enter(void *ctx)
{
    CUcontext cur = NULL;
    int has = ump__cu.ctxGetCurrent(&cur) == CUDA_SUCCESS && cur;
    if (!ctx) {
        if (has)
            return 0;
        ctx = ump__own_ctx();
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
