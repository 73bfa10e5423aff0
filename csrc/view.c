/*
 * view.c - views: address ranges of their own over physical memory.
 *
 * A view is a region with a reservation of its own over physical memory that
 * is either its own (shared, ring, striped), another process's (imported), or
 * the main range's (an alias). Its gh records each mapping, a handle's
 * `view` the handles it owns, a handle's `pins` the aliases that map it:
 * that record is also the undo log, so a view that fails half-way is taken
 * apart by the same view_close that ends a finished one.
 *
 * A pinned handle stays where it is: scavenging and migration leave it alone
 * (an alias would keep the old memory while the block moved to new). A
 * view's own handles are never cached, scavenged or trimmed; they go when the
 * view does. Physical memory another process imported stays alive there
 * after the view releases its handle: the driver (or the kernel, for a memfd)
 * frees it when the last process lets go.
 */
#include "pools.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int view_kind(int kind) { return kind >= UMP_VIEW_SHARED; }

static region_t *view_get(pool_t *p, int v)
{
    return v >= 0 && v < p->nbufs && p->bufs[v].live && view_kind(p->bufs[v].kind) ? &p->bufs[v]
                                                                                 : NULL;
}

/* Unmap, release what it owns, unpin what it borrows, free the reservation.
 * The caller synchronised (or nothing ran on it yet). */
static void view_close(pool_t *p, int v)
{
    region_t *r = &p->bufs[v];
    for (uint64_t g = 0; g < r->ngran;) {
        int64_t i = r->gh[g];
        if (i < 0) {
            g++;
            continue;
        }
        ump__ph_unmap(&p->ph, r->va + g * p->ph.gran, p->hs[i].ngran * p->ph.gran);
        if (r->kind == UMP_VIEW_ALIAS)
            p->hs[i].pins--;
        p->st.view_bytes -= p->hs[i].ngran * p->ph.gran;
        g += p->hs[i].ngran;
    }
    for (size_t i = 0; i < p->nh; i++)
        if (p->hs[i].ngran && p->hs[i].view == v + 1)
            ump__handle_drop(p, (int64_t)i);
    p->st.views--;
    ump__region_close(p, v);
}

/* Open a view of `ngran` granules that creates `creates` bytes of physical
 * memory: enter the device, reserve. A view larger than the limit is
 * refused before its reservation and granule map cost anything. */
static int view_begin(pool_t *p, int kind, uint64_t ngran, uint64_t creates, int *v, int *pushed)
{
    *v = -1;
    int status = ump__ph_enter(&p->ph, pushed);
    if (status == UMP_OK && p->st.limit_bytes && creates > p->st.limit_bytes)
        status = UMP_ERR_CAP;
    if (status == UMP_OK && (kind == UMP_VIEW_SHARED || kind == UMP_VIEW_IMPORTED))
        status = ump__ph_shareable(&p->ph);
    uint64_t t0 = now_ns();
    if (status == UMP_OK)
        status = ump__region_open(p, kind, ngran, v);
    if (status == UMP_OK) {
        p->st.views++;
        p->bufs[*v].times = (ump_vmm_view_times_t){.reserve_ns = now_ns() - t0};
    } else {
        *v = -1;
    }
    return status;
}

/* Grant access to the whole view; on any failure take it apart. */
static int view_end(pool_t *p, int v, int status, int pushed)
{
    if (status == UMP_OK) {
        region_t *r = &p->bufs[v];
        uint64_t t0 = now_ns();
        status = ump__injected_failure();
        if (status == UMP_OK)
            status = ump__ph_access(&p->ph, r->va, r->ngran * p->ph.gran);
        r->times.access_ns += now_ns() - t0;
        if (status == UMP_OK)
            r->size = r->ngran * p->ph.gran;
    }
    if (status != UMP_OK) {
        if (v >= 0) {
            view_close(p, v);
            p->st.rollbacks++;
        }
        p->st.failures++;
    }
    ump__ph_leave(&p->ph, pushed);
    return status;
}

/* A handle of `ngran` granules on `device`, owned by view v. */
static int view_handle(pool_t *p, int v, uint64_t ngran, int device, int exportable, int64_t *out)
{
    uint64_t bytes = ngran * p->ph.gran, limit = p->st.limit_bytes, h;
    if (limit && p->st.physical_bytes + bytes > limit)
        ump__release_cached(p, 0);
    if (limit && p->st.physical_bytes + bytes > limit)
        return UMP_ERR_CAP;
    uint64_t t0 = now_ns();
    int status = ump__ph_create(&p->ph, bytes, device, exportable, &h);
    if ((status == CUDA_ERROR_OUT_OF_MEMORY || status == UMP_ERR_NOMEM) && ump__release_cached(p, 0))
        status = ump__ph_create(&p->ph, bytes, device, exportable, &h);
    p->bufs[v].times.physical_ns += now_ns() - t0;
    if (status != UMP_OK)
        return status;
    *out = ump__handle_new(p, h, ngran, device, v + 1, 0);
    if (*out < 0) {
        ump__ph_release(&p->ph, h);
        return UMP_ERR_NOMEM;
    }
    return UMP_OK;
}

/* Map handle i at granule g of view v. */
static int view_map(pool_t *p, int v, uint64_t g, int64_t i)
{
    region_t *r = &p->bufs[v];
    handle_t *e = &p->hs[i];
    uint64_t t0 = now_ns();
    int status = ump__ph_map(&p->ph, r->va + g * p->ph.gran, e->ngran * p->ph.gran, e->h);
    r->times.map_ns += now_ns() - t0;
    if (status != UMP_OK)
        return status;
    for (uint64_t k = 0; k < e->ngran; k++)
        r->gh[g + k] = i;
    if (r->kind == UMP_VIEW_ALIAS)
        e->pins++;
    p->st.view_bytes += e->ngran * p->ph.gran;
    return UMP_OK;
}

struct make_args {
    uint64_t bytes;
    int *view;
};

static int make_shared(pool_t *p, void *arg)
{
    struct make_args *a = arg;
    uint64_t n = granules(p, a->bytes);
    int v, pushed;
    int64_t i;
    int status = view_begin(p, UMP_VIEW_SHARED, n, n * p->ph.gran, &v, &pushed);
    if (status == UMP_OK)
        status = view_handle(p, v, n, p->ph.device, 1, &i);
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    status = view_end(p, v, status, pushed);
    if (status == UMP_OK)
        *a->view = v;
    return status;
}

int ump_vmm_shared_create(int id, uint64_t bytes, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES)
        return ump__set_status(UMP_ERR_ARG);
    struct make_args a = {bytes, view};
    return ump__pool_run(id, make_shared, &a);
}

struct export_args {
    int view, *fd;
};

static int export(pool_t *p, void *arg)
{
    struct export_args *a = arg;
    region_t *r = view_get(p, a->view);
    int pushed = 0;
    int status = r && r->kind == UMP_VIEW_SHARED ? ump__ph_enter(&p->ph, &pushed) : UMP_ERR_ARG;
    if (status == UMP_OK)
        status = ump__injected_failure();
    if (status == UMP_OK)
        status = ump__ph_export(&p->ph, p->hs[r->gh[0]].h, a->fd);
    if (status == UMP_OK)
        p->st.exports++;
    ump__ph_leave(&p->ph, pushed);
    return status;
}

int ump_vmm_export(int id, int view, int *fd)
{
    if (!fd)
        return ump__set_status(UMP_ERR_ARG);
    struct export_args a = {view, fd};
    return ump__pool_run(id, export, &a);
}

/* Check a peer's descriptor and take a handle of our own for it, before
 * anything is reserved or allocated for the size the peer claims. */
static int import_take(pool_t *p, int fd, uint64_t bytes, uint64_t *h, int *device,
                       uint64_t *took_ns)
{
    uint64_t t0 = now_ns();
    int status = ump__ph_shareable(&p->ph);
    if (status == UMP_OK)
        status = ump__injected_failure();
    if (status == UMP_OK)
        status = ump__ph_import(&p->ph, fd, bytes, h, device);
    *took_ns = now_ns() - t0;
    return status;
}

struct import_args {
    int fd;
    uint64_t bytes;
    int device, *view;
};

static int import(pool_t *p, void *arg)
{
    struct import_args *a = arg;
    if (a->bytes % p->ph.gran || a->bytes > UMP_VMM_MAX_BYTES)
        return UMP_ERR_HANDLE; /* not the size of any memory we export */
    int v = -1, pushed, inner = 0, taken = 0;
    int64_t i = -1;
    uint64_t h = 0, took_ns = 0, n = a->bytes / p->ph.gran;
    int status = ump__ph_enter(&p->ph, &pushed);
    if (status == UMP_OK)
        status = import_take(p, a->fd, a->bytes, &h, &a->device, &took_ns);
    taken = status == UMP_OK;
    if (status == UMP_OK)
        status = view_begin(p, UMP_VIEW_IMPORTED, n, 0, &v, &inner);
    if (status == UMP_OK) {
        p->bufs[v].times.physical_ns = took_ns;
        i = ump__handle_new(p, h, n, a->device, v + 1, 1);
        if (i < 0)
            status = UMP_ERR_NOMEM;
    }
    if (taken && i < 0)
        ump__ph_release(&p->ph, h); /* recorded nowhere: no view would release it */
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    status = view_end(p, v, status, inner);
    ump__ph_leave(&p->ph, pushed);
    if (status == UMP_OK)
        *a->view = v;
    return status;
}

int ump_vmm_import(int id, int fd, uint64_t bytes, int device, int *view)
{
    if (!view || fd < 0 || bytes == 0)
        return ump__set_status(UMP_ERR_ARG);
    struct import_args a = {fd, bytes, device, view};
    return ump__pool_run(id, import, &a);
}

struct alias_args {
    uintptr_t ptr;
    uint64_t bytes;
    uintptr_t *alias;
    int *view;
};

/* Map the handles under [ptr, ptr+bytes) of one live block a second time.
 * cuMemMap maps whole handles only (its offset must be 0), so the alias
 * spans the handles' granules; *alias is where ptr appears in it. */
static int make_alias(pool_t *p, void *arg)
{
    struct alias_args *a = arg;
    uint64_t off = a->ptr - p->main.va, gran = p->ph.gran;
    blk_t *b = a->ptr >= p->main.va ? ump__block_below(p, off) : NULL;
    if (!b || off + a->bytes > b->off + b->size || off + a->bytes < off)
        return UMP_ERR_ARG; /* not inside one live block */
    /* A live block's granules are all backed (touch mapped them). */
    handle_t *first = &p->hs[p->main.gh[off / gran]];
    handle_t *last = &p->hs[p->main.gh[(off + a->bytes - 1) / gran]];
    uint64_t a0 = first->at, a1 = last->at + last->ngran;
    int v, pushed;
    int status = view_begin(p, UMP_VIEW_ALIAS, a1 - a0, 0, &v, &pushed);
    for (uint64_t g = a0; g < a1 && status == UMP_OK;) {
        int64_t i = p->main.gh[g];
        status = view_map(p, v, g - a0, i);
        g += p->hs[i].ngran;
    }
    status = view_end(p, v, status, pushed);
    if (status == UMP_OK) {
        *a->alias = p->bufs[v].va + (off - a0 * gran);
        *a->view = v;
    }
    return status;
}

int ump_vmm_alias_create(int id, uintptr_t ptr, uint64_t bytes, uintptr_t *alias, int *view)
{
    if (bytes == 0 || !alias || !view)
        return ump__set_status(UMP_ERR_ARG);
    struct alias_args a = {ptr, bytes, alias, view};
    return ump__pool_run(id, make_alias, &a);
}

/* One handle of `bytes` (whole granules) mapped at va and again at
 * va + bytes: byte i and byte i + bytes are the same memory. */
static int make_ring(pool_t *p, void *arg)
{
    struct make_args *a = arg;
    if (a->bytes % p->ph.gran)
        return UMP_ERR_ARG;
    uint64_t n = a->bytes / p->ph.gran;
    int v, pushed;
    int64_t i;
    int status = view_begin(p, UMP_VIEW_RING, 2 * n, a->bytes, &v, &pushed);
    if (status == UMP_OK)
        status = view_handle(p, v, n, p->ph.device, 0, &i);
    if (status == UMP_OK)
        status = view_map(p, v, 0, i);
    if (status == UMP_OK)
        status = view_map(p, v, n, i);
    status = view_end(p, v, status, pushed);
    if (status == UMP_OK)
        *a->view = v;
    return status;
}

int ump_vmm_ring_create(int id, uint64_t bytes, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES / 2)
        return ump__set_status(UMP_ERR_ARG);
    struct make_args a = {bytes, view};
    return ump__pool_run(id, make_ring, &a);
}

struct striped_args {
    uint64_t bytes;
    const int *devices;
    int ndevices, *view;
};

/* Granule g on devices[g % ndevices], every device of the pool given access
 * to all of it. The devices must have been granted access to the pool. */
static int make_striped(pool_t *p, void *arg)
{
    struct striped_args *a = arg;
    for (int d = 0; d < a->ndevices; d++) {
        int granted = 0;
        for (int k = 0; k < p->ph.ndev; k++)
            granted |= p->ph.devs[k] == a->devices[d];
        if (!granted)
            return UMP_ERR_ARG; /* grant them access first */
    }
    uint64_t n = granules(p, a->bytes);
    int v, pushed;
    int status = view_begin(p, UMP_VIEW_STRIPED, n, n * p->ph.gran, &v, &pushed);
    for (uint64_t g = 0; status == UMP_OK && g < n; g++) {
        int64_t i;
        status = view_handle(p, v, 1, a->devices[g % (uint64_t)a->ndevices], 0, &i);
        if (status == UMP_OK)
            status = view_map(p, v, g, i);
    }
    status = view_end(p, v, status, pushed);
    if (status == UMP_OK)
        *a->view = v;
    return status;
}

int ump_vmm_striped_create(int id, uint64_t bytes, const int *devices, int ndevices, int *view)
{
    if (!view || bytes == 0 || bytes > UMP_VMM_MAX_BYTES || !devices || ndevices < 1 ||
        ndevices > UMP_VMM_MAX_DEVICES)
        return ump__set_status(UMP_ERR_ARG);
    struct striped_args a = {bytes, devices, ndevices, view};
    return ump__pool_run(id, make_striped, &a);
}

int ump_vmm_view_info(int id, int view, uintptr_t *ptr, uint64_t *size, int *kind,
                      ump_vmm_view_times_t *times)
{
    return ump__region_info(id, view_get, view, ptr, size, kind, times);
}

static int destroy(pool_t *p, void *arg)
{
    int view = *(int *)arg;
    int status = view_get(p, view) ? ump__ph_sync(&p->ph) : UMP_ERR_ARG;
    if (status == UMP_OK) {
        int pushed;
        ump__ph_enter(&p->ph, &pushed);
        view_close(p, view);
        ump__ph_leave(&p->ph, pushed);
    }
    return status;
}

int ump_vmm_view_destroy(int id, int view) { return ump__pool_run(id, destroy, &view); }
