/*
 * buffer.c - growable buffers: a reservation of their own, mapped from the
 * front, so a buffer grows and shrinks in place and its address never
 * changes. A shrinking buffer unmaps only handles wholly past its new end.
 */
#include "pools.h"

static region_t *buffer_get(pool_t *p, int buf)
{
    return buf >= 0 && buf < p->nbufs && p->bufs[buf].live && p->bufs[buf].kind == REGION_BUFFER
               ? &p->bufs[buf]
               : NULL;
}

struct create_args {
    uint64_t max_bytes;
    int *buf;
};

static int create(pool_t *p, void *arg)
{
    struct create_args *a = arg;
    return ump__region_open(p, REGION_BUFFER, granules(p, a->max_bytes), a->buf);
}

int ump_vmm_buffer_create(int id, uint64_t max_bytes, int *buf)
{
    if (!buf || max_bytes == 0 || max_bytes > UMP_VMM_MAX_BYTES)
        return ump__set_status(UMP_ERR_ARG);
    struct create_args a = {max_bytes, buf};
    return ump__pool_run(id, create, &a);
}

int ump_vmm_buffer_info(int id, int buf, uintptr_t *ptr, uint64_t *size)
{
    return ump__region_info(id, buffer_get, buf, ptr, size, NULL, NULL);
}

struct resize_args {
    int buf;
    uint64_t bytes;
};

static int resize(pool_t *p, void *arg)
{
    struct resize_args *a = arg;
    region_t *r = buffer_get(p, a->buf);
    int status = UMP_OK;
    if (!r || a->bytes > r->ngran * p->ph.gran) {
        status = UMP_ERR_ARG; /* past its reservation the address would change */
    } else {
        uint64_t need = granules(p, a->bytes), have = 0;
        while (have < r->ngran && r->gh[have] >= 0)
            have++;
        if (need > have) {
            status = ump__map_run(p, a->buf + 1, have, need - have);
        } else if (need < have) {
            status = ump__ph_sync(&p->ph); /* a kernel may still use the tail */
            if (status == UMP_OK)
                ump__unmap_from(p, a->buf + 1, need);
        }
        if (status == UMP_OK) {
            p->st.buffer_bytes = p->st.buffer_bytes - r->size + a->bytes;
            r->size = a->bytes;
        }
    }
    if (status != UMP_OK)
        p->st.failures++;
    return status;
}

int ump_vmm_buffer_resize(int id, int buf, uint64_t bytes)
{
    struct resize_args a = {buf, bytes};
    return ump__pool_run(id, resize, &a);
}

static int destroy(pool_t *p, void *arg)
{
    int buf = *(int *)arg;
    region_t *r = buffer_get(p, buf);
    int status = r ? ump__ph_sync(&p->ph) : UMP_ERR_ARG;
    if (status == UMP_OK) {
        int pushed;
        ump__unmap_from(p, buf + 1, 0);
        p->st.buffer_bytes -= r->size;
        ump__ph_enter(&p->ph, &pushed);
        ump__region_close(p, buf);
        ump__ph_leave(&p->ph, pushed);
    }
    return status;
}

int ump_vmm_buffer_destroy(int id, int buf) { return ump__pool_run(id, destroy, &buf); }
