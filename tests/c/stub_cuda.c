/*
 * stub_cuda.c - a driver for machines without a GPU: the entry points
 * ump_cuda_load() requires and those the probe and the contexts call, over
 * host memory. It lets the sanitizer drivers run the core's CUDA paths
 * (contexts pushed per provider call, managed chunks, advice), and the
 * Python tests run the probe, primary contexts and free memory through the
 * C core (tests/test_driver.py). It answers as a driver with STUB_CUDA_DEVICES
 * devices (1 unless set) would; it checks little and is no stand-in for the
 * GPU tests.
 *
 * STUB_CUDA_FULL=1: cuDevicePrimaryCtxRetain fails with
 * CUDA_ERROR_OUT_OF_MEMORY, as on a GPU without room for a context.
 * stub_cuda_retained(device): the retains not yet released, for the tests.
 *
 * cc -shared -fPIC tests/c/stub_cuda.c -o libcuda_stub.so
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;
typedef int CUdevice;
typedef struct { int type, id; } CUmemLocation;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101, MAX_STUB_DEVICES = 8 };

static __thread CUcontext current[8];
static __thread int depth;
static int retained[MAX_STUB_DEVICES];

static int devices(void)
{
    const char *n = getenv("STUB_CUDA_DEVICES");
    int count = n ? atoi(n) : 1;
    return count < 0 ? 0 : count > MAX_STUB_DEVICES ? MAX_STUB_DEVICES : count;
}

int stub_cuda_retained(int device)
{
    return device >= 0 && device < MAX_STUB_DEVICES ? __atomic_load_n(&retained[device], __ATOMIC_RELAXED) : -1;
}

CUresult cuMemAllocManaged(uintptr_t *p, size_t size, unsigned flags)
{
    (void)flags;
    void *m = NULL;
    if (posix_memalign(&m, 4096, size))
        return OUT_OF_MEMORY;
    *p = (uintptr_t)m;
    return OK;
}

CUresult cuMemFree_v2(uintptr_t p) { free((void *)p); return OK; }
CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) { (void)p; (void)size; (void)flags; return OK; }
CUresult cuMemHostUnregister(void *p) { (void)p; return OK; }
CUresult cuMemAdvise_v2(uintptr_t p, size_t size, int advice, CUmemLocation loc)
{
    (void)p; (void)size; (void)advice; (void)loc;
    return OK;
}

CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = depth ? current[depth - 1] : NULL;
    return OK;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (depth == 8)
        return INVALID_VALUE;
    current[depth++] = ctx;
    return OK;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    if (!depth)
        return INVALID_VALUE;
    *ctx = current[--depth];
    return OK;
}

CUresult cuGetErrorName(CUresult status, const char **name)
{
    switch (status) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return OK;
    default: *name = NULL; return INVALID_VALUE; /* as the driver answers an unknown status */
    }
}

/* --- the probe: no context needed, none made ------------------------------ */

CUresult cuInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return OK; }
CUresult cuDeviceGetCount(int *count) { *count = devices(); return OK; }

CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    if (ordinal < 0 || ordinal >= devices())
        return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

/* An H100-like device without HMM/ATS: managed memory, concurrent access,
 * registered memory at its host address, VMM with file descriptors. */
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev)
{
    if (dev < 0 || dev >= devices())
        return INVALID_DEVICE;
    switch (attribute) {
    case 75: *value = 9; break;  /* compute capability major */
    case 76: *value = 0; break;  /* minor */
    case 83: *value = 1; break;  /* managed memory */
    case 88: *value = 0; break;  /* pageable memory access */
    case 89: *value = 1; break;  /* concurrent managed access */
    case 91: *value = 1; break;  /* host pointer for registered memory */
    case 100: *value = 0; break; /* uses host page tables */
    case 102: *value = 1; break; /* virtual memory management */
    case 103: *value = 1; break; /* POSIX file descriptor handles */
    default: return INVALID_VALUE;
    }
    return OK;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (dev < 0 || dev >= devices() || len <= 0)
        return INVALID_VALUE;
    snprintf(name, (size_t)len, "ump stub GPU %d", dev);
    return OK;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    *bytes = (size_t)16 << 30;
    return dev >= 0 && dev < devices() ? OK : INVALID_DEVICE;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
    *can = dev != peer;
    return OK;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const void *prop, int option)
{
    (void)prop;
    (void)option;
    *granularity = (size_t)2 << 20; /* minimum and recommended alike, as on the H200 */
    return OK;
}

/* --- primary contexts: device d's is (void *)(0x1000 + d) ----------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    if (dev < 0 || dev >= devices())
        return INVALID_DEVICE;
    const char *full = getenv("STUB_CUDA_FULL");
    if (full && *full == '1')
        return OUT_OF_MEMORY;
    __atomic_fetch_add(&retained[dev], 1, __ATOMIC_RELAXED);
    *ctx = (CUcontext)(uintptr_t)(0x1000 + dev);
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    if (dev < 0 || dev >= devices() || __atomic_load_n(&retained[dev], __ATOMIC_RELAXED) == 0)
        return INVALID_VALUE;
    __atomic_fetch_sub(&retained[dev], 1, __ATOMIC_RELAXED);
    return OK;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active)
{
    if (dev < 0 || dev >= devices())
        return INVALID_DEVICE;
    *flags = 0;
    *active = __atomic_load_n(&retained[dev], __ATOMIC_RELAXED) > 0;
    return OK;
}

/* 12 GiB of 16 free on the current context's device. */
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    if (!depth)
        return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    *free_bytes = (size_t)12 << 30;
    *total = (size_t)16 << 30;
    return OK;
}
