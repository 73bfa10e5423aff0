/*
 * phys.c - the physical layer of the VMM pools (phys.h): the driver's VMM
 * calls, or their emulation on memfds and mmap when the pool runs without a
 * GPU.
 *
 * The emulation behaves as the driver does where the pool can tell: a
 * handle is a memfd, a reservation is PROT_NONE address space, mapping is
 * mmap(MAP_FIXED | MAP_SHARED) of the memfd and unmapping puts PROT_NONE
 * back. So the allocator, the granule bookkeeping, handle reuse, trim,
 * transactions, views and migration run the same code under the CPU tests
 * and the sanitizers as on a GPU.
 */
#define _GNU_SOURCE
#include "phys.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int ump__ph_enter(ump__phys_t *ph, int *pushed)
{
    *pushed = 0;
    /* A child's copy of an emulated pool maps the parent's memfds
     * (MAP_SHARED): anything it mapped or moved would be the parent's
     * memory. Pools the child makes itself are its own. */
    if (ph->provider == UMP_PROVIDER_HOST)
        return ph->inherited ? UMP_ERR_FORKED : UMP_OK;
    int status = ump__cuda_ready();
    if (status == UMP_OK)
        *pushed = ump__ctx_enter(ph->ctx);
    return status;
}

void ump__ph_leave(ump__phys_t *ph, int pushed)
{
    if (ph->provider != UMP_PROVIDER_HOST)
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

int ump__ph_granularity(int provider, int device, void *ctx, uint64_t *gran)
{
    if (provider == UMP_PROVIDER_HOST) {
        *gran = (uint64_t)2 << 20; /* the granularity of the GPUs we measured */
        return UMP_OK;
    }
    int status = ump__cuda_ready();
    if (status == UMP_OK && !ump__cu.vmm)
        status = UMP_ERR_NOCUDA; /* a driver without the VMM API */
    if (status != UMP_OK)
        return status;
    CUmemAllocationProp prop = prop_for(device, 0);
    size_t g = 0;
    int pushed = ump__ctx_enter(ctx);
    status = ump__cu.memGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    ump__ctx_leave(pushed);
    if (status != CUDA_SUCCESS || g == 0)
        return status ? status : UMP_ERR_ARG;
    *gran = g;
    return UMP_OK;
}

int ump__ph_shareable(ump__phys_t *ph)
{
    return ph->provider == UMP_PROVIDER_HOST || ump__cu.share ? UMP_OK : UMP_ERR_UNSUPPORTED;
}

/* The emulation's exportable memory: a memfd of this name whose size is
 * sealed, so no process holding it can shrink it under another's mapping
 * (which would turn that process's reads into SIGBUS). An importer checks
 * both, which tells a handle of ump's from any other file descriptor. */
#define SHARE_NAME "ump-vmm-shared"
#define SHARE_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

int ump__ph_create(ump__phys_t *ph, uint64_t bytes, int device, int exportable, uint64_t *out)
{
    int status = ump__injected_failure();
    if (status != UMP_OK)
        return status;
    if (ph->provider == UMP_PROVIDER_HOST) {
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
int ump__ph_export(ump__phys_t *ph, uint64_t h, int *fd)
{
    *fd = -1;
    if (ph->provider == UMP_PROVIDER_HOST) {
        *fd = fcntl((int)h, F_DUPFD_CLOEXEC, 0);
        return *fd < 0 ? ump__os_status(errno) : UMP_OK;
    }
    return ump__cu.memExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

/* A handle of our own for the physical memory behind another process's
 * exported fd (which stays the caller's). `bytes`: the size the exporter
 * described; `*device` is set to where the memory lives. */
int ump__ph_import(ump__phys_t *ph, int fd, uint64_t bytes, uint64_t *h, int *device)
{
    if (fcntl(fd, F_GETFD) < 0)
        return UMP_ERR_HANDLE; /* closed */
    if (ph->provider == UMP_PROVIDER_HOST) {
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

void ump__ph_release(ump__phys_t *ph, uint64_t h)
{
    if (ph->provider == UMP_PROVIDER_HOST)
        close((int)h);
    else
        ump__cu.memRelease(h);
}

int ump__ph_map_raw(ump__phys_t *ph, uintptr_t va, uint64_t bytes, uint64_t h)
{
    if (ph->provider == UMP_PROVIDER_HOST) {
        void *m = mmap((void *)va, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)h, 0);
        return m == MAP_FAILED ? ump__os_status(errno) : UMP_OK;
    }
    return ump__cu.memMap(va, bytes, 0, h, 0);
}

int ump__ph_map(ump__phys_t *ph, uintptr_t va, uint64_t bytes, uint64_t h)
{
    int status = ump__injected_failure();
    return status != UMP_OK ? status : ump__ph_map_raw(ph, va, bytes, h);
}

int ump__ph_unmap(ump__phys_t *ph, uintptr_t va, uint64_t bytes)
{
    if (ph->provider == UMP_PROVIDER_HOST) {
        /* Back to an inaccessible reservation, as cuMemUnmap leaves it. */
        void *m = mmap((void *)va, bytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        return m == MAP_FAILED ? UMP_ERR_NOMEM : UMP_OK;
    }
    return ump__cu.memUnmap(va, bytes);
}

/* Every mapping starts inaccessible: grant each device of the pool access. */
int ump__ph_access(ump__phys_t *ph, uintptr_t va, uint64_t bytes)
{
    if (ph->provider == UMP_PROVIDER_HOST)
        return UMP_OK;
    CUmemAccessDesc desc[UMP_VMM_MAX_DEVICES];
    for (int i = 0; i < ph->ndev; i++) {
        desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        desc[i].location.id = ph->devs[i];
        desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    return ump__cu.memSetAccess(va, bytes, desc, (size_t)ph->ndev);
}

/* Before anything is unmapped: kernels on every device granted access may
 * still read the pages, not only those of the pool's own device. */
int ump__ph_sync(ump__phys_t *ph)
{
    int pushed, status = ump__ph_enter(ph, &pushed);
    if (status == UMP_OK && ph->provider != UMP_PROVIDER_HOST) {
        status = ump__cu.ctxSynchronize();
        for (int d = 1; d < ph->ndev && status == UMP_OK; d++) /* devs[0] is the pool's */
            status = ump__device_sync(ph->devs[d]);
    }
    ump__ph_leave(ph, pushed);
    return status;
}

int ump__ph_reserve(ump__phys_t *ph, uint64_t bytes, uintptr_t *va)
{
    if (ph->provider == UMP_PROVIDER_HOST) {
        void *m = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        *va = m == MAP_FAILED ? 0 : (uintptr_t)m;
        return *va ? UMP_OK : ump__os_status(errno);
    }
    return ump__cu.memAddressReserve(va, bytes, ph->gran, 0, 0);
}

void ump__ph_unreserve(ump__phys_t *ph, uintptr_t va, uint64_t bytes)
{
    if (ph->provider == UMP_PROVIDER_HOST)
        munmap((void *)va, bytes);
    else
        ump__cu.memAddressFree(va, bytes);
}

int ump__ph_copy(ump__phys_t *ph, uintptr_t dst, uintptr_t src, uint64_t bytes)
{
    if (ph->provider == UMP_PROVIDER_HOST) {
        memcpy((void *)dst, (const void *)src, bytes);
        return UMP_OK;
    }
    return ump__cu.memcpyDtoD(dst, src, bytes);
}

