/*
 * provider.c - where the arenas' chunks come from: anonymous memory from the
 * OS, managed memory from the driver, or host memory registered with it; and
 * the advice and prefetches ump gives managed memory.
 *
 * A provider call is made with no lock of ump held: CUDA calls are slow and
 * may synchronise the device.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_MIN ((size_t)4 << 20)

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
        /* As NumPy's own allocator asks for its arrays of 4 MiB or more:
         * with transparent huge pages in "madvise" mode (a common default)
         * each page of a large array otherwise faults in on its own, 4 KiB
         * at a time (a written 64 MiB np.zeros: 39 ms against 7.5). */
        if (*out && size >= HUGE_MIN)
            madvise(*out, size, MADV_HUGEPAGE);
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
    int pushed = ump__ctx_enter(ctx ? ctx : ump__own_ctx());
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
    int pushed = ump__ctx_enter(ctx ? ctx : ump__own_ctx()); /* the context that made it */
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

/* glibc's largest mmap threshold: below it stock NumPy's calloc reuses heap
 * memory and writes its zeros too, and a memset of mapped pages costs far
 * less than the page faults a program that writes the array pays after. */
#define ZERO_DROP_MIN ((size_t)32 << 20)

void ump__provider_zero(int provider, void *ptr, size_t size)
{
    /* A private anonymous page dropped with MADV_DONTNEED reads as zeros
     * and is committed again only where written, as a fresh mapping (what
     * stock NumPy's calloc gets at these sizes) gives it. A memset would
     * commit every page at once: np.zeros of a size the machine holds only
     * sparsely would exhaust its memory, and a large one takes seconds.
     * Managed memory is the driver's, and registered memory must not be
     * dropped: the CPU would get new pages while the GPU keeps the pinned
     * ones. They are written. */
    if (provider == UMP_PROVIDER_HOST && size >= ZERO_DROP_MIN) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t start = ((uintptr_t)ptr + page - 1) & ~(page - 1);
        uintptr_t end = ((uintptr_t)ptr + size) & ~(page - 1);
        if (end > start && madvise((void *)start, end - start, MADV_DONTNEED) == 0) {
            memset(ptr, 0, start - (uintptr_t)ptr);
            memset((void *)end, 0, (uintptr_t)ptr + size - end);
            return;
        }
    }
    memset(ptr, 0, size);
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
    advise((uintptr_t)ptr, size, CU_MEM_ADVISE_SET_ACCESSED_BY, ump__own_device());
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
