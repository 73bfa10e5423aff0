/*
 * migrate.c - moving the physical memory under part of a pool to another
 * device, keeping its addresses; and telling where each granule lives.
 *
 * Whole handles move, so small neighbours in them move too (they stay
 * usable: every device of the pool keeps access). A handle an alias maps
 * too stays where it is: the alias would keep the old memory.
 */
#include "pools.h"

/* Moving a handle to another device keeps its virtual address: create a
 * handle there, map it at a scratch reservation, copy, then swap the
 * mappings and grant access again. A remapped range starts with no access at
 * all, which is why a kernel touching it without cuMemSetAccess fails with
 * "unspecified launch failure". Each handle is its own transaction: until the
 * swap the old mapping is untouched, and if the swap fails the old handle,
 * whose contents did not change, is mapped back. */
static int migrate_handle(pool_t *p, int64_t i, int device)
{
    handle_t *e = &p->hs[i];
    region_t *r = region_of(p, e->region);
    uintptr_t va = r->va + e->at * p->ph.gran, tmp = 0;
    uint64_t bytes = e->ngran * p->ph.gran, nh;
    int status = ump__ph_create(&p->ph, bytes, device, 0, &nh);
    if (status != UMP_OK)
        return status;
    status = ump__ph_reserve(&p->ph, bytes, &tmp);
    if (status == UMP_OK) {
        status = ump__ph_map(&p->ph, tmp, bytes, nh);
        if (status == UMP_OK) {
            status = ump__ph_access(&p->ph, tmp, bytes);
            if (status == UMP_OK)
                status = ump__ph_copy(&p->ph, tmp, va, bytes);
            if (status == UMP_OK)
                status = ump__ph_sync(&p->ph);
            ump__ph_unmap(&p->ph, tmp, bytes);
        }
        ump__ph_unreserve(&p->ph, tmp, bytes);
    }
    if (status == UMP_OK) {
        status = ump__ph_unmap(&p->ph, va, bytes);
        if (status == UMP_OK) {
            status = ump__ph_map(&p->ph, va, bytes, nh);
            if (status == UMP_OK)
                status = ump__ph_access(&p->ph, va, bytes);
            if (status != UMP_OK) {
                ump__ph_unmap(&p->ph, va, bytes);
                ump__ph_map(&p->ph, va, bytes, e->h);
                ump__ph_access(&p->ph, va, bytes);
            }
        }
    }
    if (status != UMP_OK) {
        ump__ph_release(&p->ph, nh);
        p->st.rollbacks++;
        return status;
    }
    ump__ph_release(&p->ph, e->h);
    e->h = nh;
    e->device = device;
    p->st.handles_created++;
    p->st.handles_released++;
    p->st.migrations++;
    return UMP_OK;
}

struct migrate_args {
    uintptr_t ptr;
    uint64_t bytes;
    int device;
};

/* The granules [*g0, *g1] of region r under [ptr, ptr+bytes), if they may
 * move to `device`. */
static int movable(pool_t *p, struct migrate_args *a, region_t **out, uint64_t *g0, uint64_t *g1)
{
    int region, granted = 0;
    region_t *r = ump__region_at(p, a->ptr, &region);
    for (int d = 0; d < p->ph.ndev; d++)
        granted |= p->ph.devs[d] == a->device;
    /* region_at: ptr >= r->va, so the end is not below ptr (ptr + bytes may wrap) */
    if (!r || !granted || a->bytes > r->va + r->ngran * p->ph.gran - a->ptr ||
        (region != 0 && r->kind != REGION_BUFFER))
        return UMP_ERR_ARG; /* a view's handles are mapped elsewhere too, or not ours */
    *g0 = (a->ptr - r->va) / p->ph.gran;
    *g1 = (a->ptr + a->bytes - 1 - r->va) / p->ph.gran;
    for (uint64_t g = *g0; g <= *g1; g++)
        if (r->gh[g] < 0 || p->hs[r->gh[g]].pins)
            return UMP_ERR_ARG; /* not backed, or an alias maps it too */
    *out = r;
    return UMP_OK;
}

static int migrate(pool_t *p, void *arg)
{
    struct migrate_args *a = arg;
    region_t *r = NULL;
    uint64_t g0 = 0, g1 = 0;
    int pushed = 0, status = movable(p, a, &r, &g0, &g1);
    if (status == UMP_OK)
        status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK)
        status = ump__ph_sync(&p->ph); /* no kernel may use the old pages during the copy */
    for (uint64_t g = g0; g <= g1 && status == UMP_OK;) {
        int64_t i = r->gh[g];
        g = p->hs[i].at + p->hs[i].ngran;
        if (p->hs[i].device != a->device)
            status = migrate_handle(p, i, a->device);
    }
    ump__ph_leave(&p->ph, pushed);
    return status;
}

int ump_vmm_migrate(int id, uintptr_t ptr, uint64_t bytes, int device)
{
    if (bytes == 0 || device < 0)
        return ump__set_status(UMP_ERR_ARG);
    struct migrate_args a = {ptr, bytes, device};
    return ump__pool_run(id, migrate, &a);
}

struct device_of_args {
    uintptr_t ptr;
    uint64_t bytes;
    int *device;
};

static int device_of(pool_t *p, void *arg)
{
    struct device_of_args *a = arg;
    int region, dev = -2;
    region_t *r = ump__region_at(p, a->ptr, &region);
    if (r && a->bytes <= r->va + r->ngran * p->ph.gran - a->ptr) {
        uint64_t g0 = (a->ptr - r->va) / p->ph.gran, g1 = (a->ptr + a->bytes - 1 - r->va) / p->ph.gran;
        for (uint64_t g = g0; g <= g1; g++) {
            int d = r->gh[g] < 0 ? -3 : p->hs[r->gh[g]].device;
            dev = dev == -2 ? d : (dev == d ? dev : -1);
        }
    }
    if (dev < -1)
        return UMP_ERR_ARG;
    *a->device = dev;
    return UMP_OK;
}

/* The device each byte of [ptr, ptr+bytes) lives on, if one; -1 if mixed. */
int ump_vmm_device_of(int id, uintptr_t ptr, uint64_t bytes, int *device)
{
    if (bytes == 0 || !device)
        return ump__set_status(UMP_ERR_ARG);
    struct device_of_args a = {ptr, bytes, device};
    return ump__pool_run(id, device_of, &a);
}
