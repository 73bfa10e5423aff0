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
#include "cudadrv.h"
#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

static struct {
    void *lib;
    CUresult (*memAllocManaged)(CUdeviceptr *, size_t, unsigned);
    CUresult (*memFree)(CUdeviceptr);
    CUresult (*memHostRegister)(void *, size_t, unsigned);
    CUresult (*memHostUnregister)(void *);
    CUresult (*ctxGetCurrent)(CUcontext *);
    CUresult (*ctxPushCurrent)(CUcontext);
    CUresult (*ctxPopCurrent)(CUcontext *);
    CUresult (*getErrorName)(CUresult, const char **);
    /* CUDA 12.2 added the CUmemLocation forms; CUDA 13 keeps only those
     * under the plain names, so prefer the _v2 symbols and fall back. */
    CUresult (*prefetch_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream);
    CUresult (*prefetch_v1)(CUdeviceptr, size_t, int, CUstream);
    CUresult (*advise_v2)(CUdeviceptr, size_t, int, CUmemLocation);
    CUresult (*advise_v1)(CUdeviceptr, size_t, int, int);
} cu;

static CUcontext ump_ctx;
static int ump_device;
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

#define LOAD(field, name) (*(void **)&cu.field = dlsym(lib, name))

int ump_cuda_load(const char *path)
{
    pthread_mutex_lock(&load_lock);
    if (cu.lib) {
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
    if (!cu.prefetch_v2)
        LOAD(prefetch_v1, "cuMemPrefetchAsync");
    if (!cu.advise_v2)
        LOAD(advise_v1, "cuMemAdvise");
    if (!cu.memAllocManaged || !cu.memFree || !cu.memHostRegister ||
        !cu.memHostUnregister || !cu.ctxGetCurrent || !cu.ctxPushCurrent ||
        !cu.ctxPopCurrent || !cu.getErrorName) {
        memset(&cu, 0, sizeof cu);
        dlclose(lib);
        pthread_mutex_unlock(&load_lock);
        return ump__set_status(UMP_ERR_NOCUDA);
    }
    cu.lib = lib;
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
    ump_ctx = (CUcontext)ctx;
    ump_device = device;
    return UMP_OK;
}

int ump_cuda_error_name(int status, char *buf, size_t len)
{
    const char *name = ump__status_name(status);
    if (!name && cu.lib && cu.getErrorName(status, &name) != CUDA_SUCCESS)
        name = NULL;
    if (!name)
        name = "CUDA_ERROR_UNKNOWN";
    if (buf && len) {
        strncpy(buf, name, len - 1);
        buf[len - 1] = 0;
    }
    return UMP_OK;
}

/* Run CUDA calls with ump's context current: the calling thread may have
 * none (NumPy allocates on any thread). Returns 1 if a context was pushed. */
static int ctx_enter(void)
{
    CUcontext cur = NULL;
    if (cu.ctxGetCurrent(&cur) == CUDA_SUCCESS && cur)
        return 0;
    return ump_ctx && cu.ctxPushCurrent(ump_ctx) == CUDA_SUCCESS;
}

static void ctx_leave(int pushed)
{
    CUcontext dummy;
    if (pushed)
        cu.ctxPopCurrent(&dummy);
}

static int cuda_ready(void)
{
    if (ump__forked)
        return UMP_ERR_FORKED;
    return cu.lib ? UMP_OK : UMP_ERR_NOCUDA;
}

void *ump__cuda_sym(const char *name)
{
    return cu.lib ? dlsym(cu.lib, name) : NULL;
}

int ump__cuda_ready(void) { return cuda_ready(); }

int ump__ctx_push(void *ctx)
{
    CUcontext cur = NULL;
    if (!ctx || (cu.ctxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx))
        return 0;
    return cu.ctxPushCurrent(ctx) == CUDA_SUCCESS;
}

void ump__ctx_pop(int pushed) { ctx_leave(pushed); }

static void *map_host(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

int ump__provider_alloc(int provider, size_t size, void **out, int *fresh_zero)
{
    *out = NULL;
    *fresh_zero = 0;
    if (provider == UMP_PROVIDER_HOST) {
        *out = map_host(size);
        *fresh_zero = 1;
        return *out ? UMP_OK : UMP_ERR_NOMEM;
    }
    int status = cuda_ready();
    if (status != UMP_OK)
        return status;
    int pushed = ctx_enter();
    if (provider == UMP_PROVIDER_MANAGED) {
        CUdeviceptr d = 0;
        status = cu.memAllocManaged(&d, size, CU_MEM_ATTACH_GLOBAL);
        *out = (void *)d;
    } else {
        /* The system path plus registration: with
         * canUseHostPointerForRegisteredMem = 1 the device pointer of
         * registered memory is its host pointer, so no translation. */
        void *p = map_host(size);
        if (!p) {
            status = UMP_ERR_NOMEM;
        } else {
            status = cu.memHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE |
                                                      CU_MEMHOSTREGISTER_DEVICEMAP);
            if (status != CUDA_SUCCESS)
                munmap(p, size);
            else
                *out = p;
        }
        *fresh_zero = status == CUDA_SUCCESS;
    }
    ctx_leave(pushed);
    return status;
}

int ump__provider_free(int provider, void *ptr, size_t size)
{
    if (provider == UMP_PROVIDER_HOST)
        return munmap(ptr, size) == 0 ? UMP_OK : UMP_ERR_ARG;
    int status = cuda_ready();
    if (status != UMP_OK)
        return status; /* after fork: leak rather than call CUDA */
    int pushed = ctx_enter();
    if (provider == UMP_PROVIDER_MANAGED) {
        /* cuMemFree synchronises the device, so no kernel still uses it. */
        status = cu.memFree((CUdeviceptr)ptr);
    } else {
        status = cu.memHostUnregister(ptr);
        munmap(ptr, size);
    }
    ctx_leave(pushed);
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
    if (cu.advise_v2)
        return cu.advise_v2(ptr, size, advice, location(device));
    if (cu.advise_v1)
        return cu.advise_v1(ptr, size, advice, device < 0 ? CU_DEVICE_CPU : device);
    return UMP_ERR_NOCUDA;
}

void ump__advise_host(void *ptr, size_t size)
{
    if (cuda_ready() != UMP_OK)
        return;
    int pushed = ctx_enter();
    /* Pages stay in host memory and the GPU maps them over the link: for data
     * the GPU touches once this beats any migration (see docs/backends.md). */
    advise((uintptr_t)ptr, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, -1);
    advise((uintptr_t)ptr, size, CU_MEM_ADVISE_SET_ACCESSED_BY, ump_device);
    ctx_leave(pushed);
}

int ump_advise(uintptr_t ptr, uint64_t size, int advice, int device)
{
    int status = cuda_ready();
    if (status != UMP_OK)
        return ump__set_status(status);
    int pushed = ctx_enter();
    status = advise(ptr, size, advice, device);
    ctx_leave(pushed);
    return status ? ump__set_status(status) : UMP_OK;
}

int ump_prefetch(uintptr_t ptr, uint64_t size, int device, uintptr_t stream)
{
    int status = cuda_ready();
    if (status != UMP_OK)
        return ump__set_status(status);
    int pushed = ctx_enter();
    if (cu.prefetch_v2)
        status = cu.prefetch_v2(ptr, size, location(device), 0, (CUstream)stream);
    else if (cu.prefetch_v1)
        status = cu.prefetch_v1(ptr, size, device < 0 ? CU_DEVICE_CPU : device, (CUstream)stream);
    else
        status = UMP_ERR_NOCUDA;
    ctx_leave(pushed);
    return status ? ump__set_status(status) : UMP_OK;
}
