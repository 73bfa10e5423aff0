/*
 * region.c - a pool's address ranges beyond its main one: each buffer and
 * view has a reservation of its own and a granule map of what is mapped
 * there (8 bytes per granule of host memory, for as long as it lives).
 */
#include "pools.h"

#include <stdlib.h>
#include <string.h>

int ump__region_open(pool_t *p, int kind, uint64_t ngran, int *idx)
{
    int b;
    for (b = 0; b < p->nbufs; b++)
        if (!p->bufs[b].live)
            break;
    if (b == p->nbufs) {
        region_t *bufs = realloc(p->bufs, (size_t)(p->nbufs + 1) * sizeof *bufs);
        if (!bufs)
            return UMP_ERR_NOMEM;
        p->bufs = bufs;
        memset(&bufs[p->nbufs++], 0, sizeof *bufs);
    }
    region_t *r = &p->bufs[b];
    r->gh = malloc(ngran * sizeof *r->gh);
    if (!r->gh)
        return UMP_ERR_NOMEM;
    memset(r->gh, 0xff, ngran * sizeof *r->gh);
    int pushed, status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK)
        status = ump__ph_reserve(&p->ph, ngran * p->ph.gran, &r->va);
    ump__ph_leave(&p->ph, pushed);
    if (status != UMP_OK) {
        free(r->gh);
        memset(r, 0, sizeof *r);
        return status;
    }
    r->ngran = ngran;
    r->kind = kind;
    r->live = 1;
    r->size = 0;
    p->st.reserved_bytes += ngran * p->ph.gran;
    *idx = b;
    return UMP_OK;
}

void ump__region_close(pool_t *p, int idx)
{
    region_t *r = &p->bufs[idx];
    ump__ph_unreserve(&p->ph, r->va, r->ngran * p->ph.gran);
    p->st.reserved_bytes -= r->ngran * p->ph.gran;
    free(r->gh);
    memset(r, 0, sizeof *r);
}

region_t *ump__region_at(pool_t *p, uintptr_t ptr, int *region)
{
    if (ptr >= p->main.va && ptr < p->main.va + p->main.ngran * p->ph.gran) {
        *region = 0;
        return &p->main;
    }
    for (int b = 0; b < p->nbufs; b++) {
        region_t *r = &p->bufs[b];
        if (r->live && ptr >= r->va && ptr < r->va + r->ngran * p->ph.gran) {
            *region = b + 1;
            return r;
        }
    }
    return NULL;
}

void ump__unmap_from(pool_t *p, int region, uint64_t from)
{
    region_t *r = region_of(p, region);
    for (uint64_t g = from; g < r->ngran; g++) {
        int64_t i = r->gh[g];
        if (i >= 0 && p->hs[i].at >= from)
            ump__handle_unmap(p, i);
    }
}

int ump__grant_region(pool_t *p, region_t *r)
{
    int status = UMP_OK;
    for (uint64_t g = 0; g < r->ngran && status == UMP_OK;) {
        if (r->gh[g] < 0) {
            g++;
            continue;
        }
        uint64_t e = g;
        while (e < r->ngran && r->gh[e] >= 0)
            e++;
        status = ump__ph_access(&p->ph, r->va + g * p->ph.gran, (e - g) * p->ph.gran);
        g = e;
    }
    return status;
}
