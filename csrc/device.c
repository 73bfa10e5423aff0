/*
 * device.c - what ump reads of the GPUs, and their primary contexts.
 *
 * The probe (ump_cuda_init, ump_device_probe) uses only driver calls that
 * need no CUDA context, so probing never creates one. The primary context of
 * a device is the runtime's (CuPy's) too: ump retains it rather than making
 * a context of its own, so pointers and streams mean the same to both.
 */
#include "internal.h"

#include <stddef.h>
#include <string.h>

/* UMP_OK where the probe's entry points may be called. */
static int devices_ready(void)
{
    int status = ump__cuda_ready();
    if (status == UMP_OK && !ump__cu.devices)
        status = UMP_ERR_NOCUDA; /* a driver older than the calls ump makes */
    return status;
}

/* A status for the caller, kept for ump_last_status() when it is a failure. */
static int done(int status) { return status == UMP_OK ? UMP_OK : ump__set_status(status); }

int ump_cuda_init(int *driver_version, int *count)
{
    if (!driver_version || !count)
        return ump__set_status(UMP_ERR_ARG);
    int status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.init(0);
    if (status == UMP_OK)
        status = ump__cu.driverGetVersion(driver_version);
    if (status == UMP_OK)
        status = ump__cu.deviceGetCount(count);
    return done(status);
}

/* Each attribute field of ump_device_t and the attribute that fills it. */
static const struct {
    size_t offset;
    int attribute;
} attributes[] = {
    {offsetof(ump_device_t, compute_capability_major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR},
    {offsetof(ump_device_t, compute_capability_minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR},
    {offsetof(ump_device_t, managed_memory), CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY},
    {offsetof(ump_device_t, pageable_memory_access), CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS},
    {offsetof(ump_device_t, uses_host_page_tables),
     CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES},
    {offsetof(ump_device_t, concurrent_managed_access), CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS},
    {offsetof(ump_device_t, host_pointer_for_registered_mem),
     CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM},
    {offsetof(ump_device_t, vmm_supported), CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED},
    {offsetof(ump_device_t, posix_fd_handles),
     CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED},
};

/* The minimum and recommended granularity of device memory on `device`. */
static int granularities(int device, ump_device_t *out)
{
    if (!ump__cu.memGetAllocationGranularity)
        return UMP_ERR_NOCUDA; /* the attribute says VMM, the driver has no VMM calls */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    size_t min = 0, rec = 0;
    int status = ump__cu.memGetAllocationGranularity(&min, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (status == CUDA_SUCCESS)
        status = ump__cu.memGetAllocationGranularity(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    out->vmm_granularity = min;
    out->vmm_recommended_granularity = rec;
    return status;
}

int ump_device_probe(int device, ump_device_t *out, char *name, size_t len)
{
    if (device < 0 || !out || (len && !name) || len > (size_t)1 << 20)
        return ump__set_status(UMP_ERR_ARG);
    memset(out, 0, sizeof *out);
    CUdevice dev;
    int status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&dev, device);
    for (size_t i = 0; i < sizeof attributes / sizeof *attributes && status == UMP_OK; i++) {
        int value = 0;
        status = ump__cu.deviceGetAttribute(&value, attributes[i].attribute, dev);
        *(uint64_t *)((char *)out + attributes[i].offset) = value > 0 ? (uint64_t)value : 0;
    }
    size_t total = 0;
    if (status == UMP_OK)
        status = ump__cu.deviceTotalMem(&total, dev);
    out->total_memory = total;
    if (status == UMP_OK && out->vmm_supported)
        status = granularities(device, out);
    if (status == UMP_OK && len) {
        status = ump__cu.deviceGetName(name, (int)len, dev);
        name[len - 1] = 0;
    }
    return done(status);
}

int ump_device_retain(int device, uintptr_t *ctx)
{
    if (device < 0 || !ctx)
        return ump__set_status(UMP_ERR_ARG);
    CUdevice dev;
    CUcontext c = NULL;
    int status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&dev, device);
    if (status == UMP_OK)
        status = ump__cu.primaryCtxRetain(&c, dev);
    *ctx = status == UMP_OK ? (uintptr_t)c : 0;
    return done(status);
}

int ump_device_release(int device)
{
    if (device < 0)
        return ump__set_status(UMP_ERR_ARG);
    CUdevice dev;
    int status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&dev, device);
    if (status == UMP_OK)
        status = ump__cu.primaryCtxRelease(dev);
    return done(status);
}

int ump_device_memory(uintptr_t ctx, uint64_t *free_bytes, uint64_t *total_bytes)
{
    if (!ctx || !free_bytes || !total_bytes)
        return ump__set_status(UMP_ERR_ARG);
    size_t free = 0, total = 0;
    int status = devices_ready();
    if (status == UMP_OK) {
        /* cuMemGetInfo answers for the current context's device. */
        int pushed = ump__ctx_enter((void *)ctx);
        status = ump__cu.memGetInfo(&free, &total);
        ump__ctx_leave(pushed);
    }
    *free_bytes = free;
    *total_bytes = total;
    return done(status);
}

int ump_device_can_access_peer(int device, int peer, int *can)
{
    if (device < 0 || peer < 0 || !can)
        return ump__set_status(UMP_ERR_ARG);
    CUdevice dev, other;
    int answer = 0, status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&dev, device);
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&other, peer);
    if (status == UMP_OK)
        status = ump__cu.deviceCanAccessPeer(&answer, dev, other);
    *can = status == UMP_OK && answer;
    return done(status);
}

int ump_device_active(int device, int *active)
{
    if (device < 0 || !active)
        return ump__set_status(UMP_ERR_ARG);
    CUdevice dev;
    unsigned flags;
    int on = 0, status = devices_ready();
    if (status == UMP_OK)
        status = ump__cu.deviceGet(&dev, device);
    if (status == UMP_OK)
        status = ump__cu.primaryCtxGetState(dev, &flags, &on);
    *active = status == UMP_OK && on;
    return done(status);
}

int ump_context_push(uintptr_t ctx)
{
    if (!ctx)
        return ump__set_status(UMP_ERR_ARG);
    int status = ump__cuda_ready();
    if (status == UMP_OK)
        status = ump__cu.ctxPushCurrent((CUcontext)ctx);
    return done(status);
}

int ump_context_pop(void)
{
    CUcontext popped;
    int status = ump__cuda_ready();
    if (status == UMP_OK)
        status = ump__cu.ctxPopCurrent(&popped);
    return done(status);
}

int ump__device_sync(int device)
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
