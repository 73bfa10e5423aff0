/*
 * stub_cuda.c - the few driver entry points ump_cuda_load() requires, over
 * host memory, so that the sanitizer drivers run the core's CUDA paths
 * (contexts pushed per provider call, managed chunks, advice) on a machine
 * without a GPU. It answers as a driver with one device would; it checks
 * nothing and is no stand-in for the GPU tests.
 *
 * cc -shared -fPIC tests/c/stub_cuda.c -o libcuda_stub.so
 */
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void *CUcontext;
typedef struct { int type, id; } CUmemLocation;

static __thread CUcontext current[8];
static __thread int depth;

CUresult cuMemAllocManaged(uintptr_t *p, size_t size, unsigned flags)
{
    (void)flags;
    void *m = NULL;
    if (posix_memalign(&m, 4096, size))
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *p = (uintptr_t)m;
    return 0;
}

CUresult cuMemFree_v2(uintptr_t p) { free((void *)p); return 0; }
CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) { (void)p; (void)size; (void)flags; return 0; }
CUresult cuMemHostUnregister(void *p) { (void)p; return 0; }
CUresult cuMemAdvise_v2(uintptr_t p, size_t size, int advice, CUmemLocation loc)
{
    (void)p; (void)size; (void)advice; (void)loc;
    return 0;
}

CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = depth ? current[depth - 1] : NULL;
    return 0;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (depth == 8)
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    current[depth++] = ctx;
    return 0;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    if (!depth)
        return 1;
    *ctx = current[--depth];
    return 0;
}

CUresult cuGetErrorName(CUresult status, const char **name)
{
    (void)status;
    *name = "CUDA_ERROR_FROM_THE_STUB";
    return 0;
}
