/*
 * phys.h - the physical layer of the VMM pools: reserving address ranges,
 * making physical memory, mapping it and granting devices access, on the
 * driver (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess) or on
 * its emulation without a GPU (a PROT_NONE reservation, memfds mapped with
 * mmap(MAP_FIXED | MAP_SHARED)). phys.c is the only place that calls either
 * for a pool; the pool above it (pool.h) never knows which one runs.
 */
#ifndef UMP_PHYS_H
#define UMP_PHYS_H

#include "internal.h"

/* What the physical layer needs of a pool: where memory is made and who may
 * reach it. The pool owns it and changes it under its own lock. */
typedef struct {
    int provider;      /* UMP_PROVIDER_DEVICE, or UMP_PROVIDER_HOST: the emulation */
    int device;        /* where the pool's own memory is made */
    void *ctx;         /* that device's primary context */
    uint64_t gran;     /* bytes of one granule: every size here is whole granules */
    int inherited;     /* a forked child's copy: its memory is the parent's */
    int ndev;
    int devs[UMP_VMM_MAX_DEVICES]; /* granted access, devs[0] the pool's device */
} ump__phys_t;

/* The granularity of device memory on `device` (the driver's recommended
 * one); the emulation's is that of the GPUs we measured, 2 MiB. */
UMP_HIDDEN int ump__ph_granularity(int provider, int device, void *ctx, uint64_t *gran);

/* Before a run of calls below: UMP_OK and the device's context current
 * (*pushed says whether it was pushed, for ump__ph_leave). A forked child's
 * copy of a pool may not touch its memory: UMP_ERR_FORKED. */
UMP_HIDDEN int ump__ph_enter(ump__phys_t *ph, int *pushed);
UMP_HIDDEN void ump__ph_leave(ump__phys_t *ph, int pushed);
/* UMP_OK where physical memory can be shared with other processes. */
UMP_HIDDEN int ump__ph_shareable(ump__phys_t *ph);

/* Physical memory of `bytes` on `device` (exportable: as a file descriptor);
 * subject to fault injection. */
UMP_HIDDEN int ump__ph_create(ump__phys_t *ph, uint64_t bytes, int device, int exportable,
                              uint64_t *h);
/* A new file descriptor for an exportable handle; the caller owns it. */
UMP_HIDDEN int ump__ph_export(ump__phys_t *ph, uint64_t h, int *fd);
/* A handle of our own for the physical memory behind another process's
 * exported fd (which stays the caller's), checked to be memory ump exports
 * of `bytes` where that can be told; *device: where it lives. */
UMP_HIDDEN int ump__ph_import(ump__phys_t *ph, int fd, uint64_t bytes, uint64_t *h, int *device);
UMP_HIDDEN void ump__ph_release(ump__phys_t *ph, uint64_t h);

/* Map a handle at va (inaccessible until ump__ph_access); ump__ph_map is
 * subject to fault injection, ump__ph_map_raw is not. */
UMP_HIDDEN int ump__ph_map(ump__phys_t *ph, uintptr_t va, uint64_t bytes, uint64_t h);
UMP_HIDDEN int ump__ph_map_raw(ump__phys_t *ph, uintptr_t va, uint64_t bytes, uint64_t h);
UMP_HIDDEN int ump__ph_unmap(ump__phys_t *ph, uintptr_t va, uint64_t bytes);
/* Grant every device of the access list read and write access. */
UMP_HIDDEN int ump__ph_access(ump__phys_t *ph, uintptr_t va, uint64_t bytes);
/* Wait for every device granted access: before anything is unmapped. */
UMP_HIDDEN int ump__ph_sync(ump__phys_t *ph);

UMP_HIDDEN int ump__ph_reserve(ump__phys_t *ph, uint64_t bytes, uintptr_t *va);
UMP_HIDDEN void ump__ph_unreserve(ump__phys_t *ph, uintptr_t va, uint64_t bytes);
UMP_HIDDEN int ump__ph_copy(ump__phys_t *ph, uintptr_t dst, uintptr_t src, uint64_t bytes);

#endif
