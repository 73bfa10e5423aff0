/*
 * block.c - the blocks of a pool's main range.
 *
 * Blocks are cut from the range by best fit, in 512-byte units: free blocks
 * sit in size bins, one set of bins per CUDA stream, and neighbours freed on
 * the same stream merge. A request no free block fits is cut at the end of
 * what is in use, where a free block of the request's stream grows into the
 * unused range. Blocks never move.
 *
 * Stream order: a block freed on stream S goes to S's bins and is handed out
 * again only on S, where later work is ordered after the kernels that used
 * it (as in CuPy's pool).
 *
 * A granule of the range is mapped while any live block touches it: each
 * granule counts the live blocks touching it, and each handle the granules
 * of it that are touched, so scavenging finds idle handles without a scan.
 */
#include "pools.h"

#include <stdlib.h>
#include <string.h>

static int bin_of(uint64_t bytes)
{
    uint64_t units = bytes / UMP_ALIGN;
    int b = 63 - __builtin_clzll(units);
    int sub = b >= 2 ? (int)((units >> (b - 2)) & 3) : 0;
    int i = b * 4 + sub;
    return i < NBINS ? i : NBINS - 1;
}

/* The bins of a stream that holds free blocks, or NULL. */
static sbins_t *bins_for(pool_t *p, uintptr_t stream)
{
    for (int i = 0; i < p->nsb; i++)
        if (p->sb[i].stream == stream)
            return &p->sb[i];
    return NULL;
}

/* The stream has bins, or there is room for them: make_room ran first. */
static void bin_insert(pool_t *p, blk_t *b)
{
    sbins_t *sb = bins_for(p, b->stream);
    if (!sb) {
        sb = &p->sb[p->nsb++];
        memset(sb, 0, sizeof *sb);
        sb->stream = b->stream;
    }
    b->bin = bin_of(b->size);
    b->fprev = NULL;
    b->fnext = sb->bin[b->bin];
    if (b->fnext)
        b->fnext->fprev = b;
    sb->bin[b->bin] = b;
    sb->nfree++;
}

/* Take a free block out of its bins; the stream's bins go with its last. */
static void bin_remove(pool_t *p, blk_t *b)
{
    sbins_t *sb = bins_for(p, b->stream);
    if (b->fprev)
        b->fprev->fnext = b->fnext;
    else
        sb->bin[b->bin] = b->fnext;
    if (b->fnext)
        b->fnext->fprev = b->fprev;
    b->bin = -1;
    if (--sb->nfree == 0)
        *sb = p->sb[--p->nsb];
}

/* Best fit among the stream's free blocks (sb NULL: it has none). */
static blk_t *find_fit(sbins_t *sb, uint64_t size)
{
    if (!sb)
        return NULL;
    int i0 = bin_of(size);
    blk_t *best = NULL;
    for (blk_t *b = sb->bin[i0]; b; b = b->fnext)
        if (b->size >= size && (!best || b->size < best->size))
            best = b;
    for (int i = i0 + 1; !best && i < NBINS; i++)
        for (blk_t *b = sb->bin[i]; b; b = b->fnext)
            if (!best || b->size < best->size)
                best = b;
    return best;
}

static blk_t *blk_new(uint64_t off, uint64_t size, uintptr_t stream)
{
    blk_t *b = calloc(1, sizeof *b);
    if (b) {
        b->off = off;
        b->size = size;
        b->stream = stream;
        b->bin = -1;
    }
    return b;
}

static void link_after(pool_t *p, blk_t *a, blk_t *b)
{
    b->prev = a;
    b->next = a ? a->next : NULL;
    if (b->next)
        b->next->prev = b;
    if (a)
        a->next = b;
    if (p->last == a)
        p->last = b;
}

static void unlink_blk(pool_t *p, blk_t *b)
{
    if (b->prev)
        b->prev->next = b->next;
    if (b->next)
        b->next->prev = b->prev;
    if (p->last == b)
        p->last = b->prev;
}

/* Merge a free block with free neighbours of the same stream; bin it. */
static void release_blk(pool_t *p, blk_t *b)
{
    blk_t *n = b->next, *q = b->prev;
    if (n && n->bin >= 0 && n->stream == b->stream) {
        bin_remove(p, n);
        b->size += n->size;
        unlink_blk(p, n);
        free(n);
    }
    if (q && q->bin >= 0 && q->stream == b->stream) {
        bin_remove(p, q);
        q->size += b->size;
        unlink_blk(p, b);
        free(b);
        b = q;
    }
    bin_insert(p, b);
}

static size_t live_find(pool_t *p, uint64_t off)
{
    size_t lo = 0, hi = p->nlive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (p->live[mid]->off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int live_insert(pool_t *p, blk_t *b)
{
    if (p->nlive == p->caplive) {
        size_t cap = p->caplive ? p->caplive * 2 : 256;
        blk_t **l = realloc(p->live, cap * sizeof *l);
        if (!l)
            return UMP_ERR_NOMEM;
        p->live = l;
        p->caplive = cap;
    }
    size_t i = live_find(p, b->off);
    memmove(&p->live[i + 1], &p->live[i], (p->nlive - i) * sizeof *p->live);
    p->live[i] = b;
    p->nlive++;
    return UMP_OK;
}

static void untouch(pool_t *p, blk_t *b)
{
    uint64_t g0 = b->off / p->ph.gran, g1 = (b->off + b->size - 1) / p->ph.gran;
    for (uint64_t g = g0; g <= g1; g++)
        if (--p->gref[g] == 0 && p->main.gh[g] >= 0)
            p->hs[p->main.gh[g]].busy--;
}

/* Count a block's granules as touched; map those that are not backed. */
static int touch(pool_t *p, blk_t *b)
{
    uint64_t g0 = b->off / p->ph.gran, g1 = (b->off + b->size - 1) / p->ph.gran;
    for (uint64_t g = g0; g <= g1; g++)
        if (p->gref[g]++ == 0 && p->main.gh[g] >= 0)
            p->hs[p->main.gh[g]].busy++;
    int status = UMP_OK;
    for (uint64_t g = g0; g <= g1 && status == UMP_OK;) {
        if (p->main.gh[g] >= 0) {
            g++;
            continue;
        }
        uint64_t e = g;
        while (e <= g1 && p->main.gh[e] < 0)
            e++;
        status = ump__map_run(p, 0, g, e - g);
        g = e;
    }
    if (status != UMP_OK)
        untouch(p, b); /* runs mapped before the failing one stay, idle */
    return status;
}

/* Where a block cut at top for `stream` starts: the last block if it is
 * free on that stream (it grows into the unused range), else top. */
static uint64_t tail_start(pool_t *p, uintptr_t stream)
{
    blk_t *l = p->last;
    return l && l->bin >= 0 && l->stream == stream ? l->off : p->top;
}

/* After a device-wide synchronisation, free blocks of every stream may be
 * handed out on any stream: retag them all and merge neighbours. */
static void merge_streams(pool_t *p, uintptr_t stream)
{
    ump__ph_sync(&p->ph);
    blk_t *b = p->last;
    while (b && b->prev)
        b = b->prev;
    for (; b; b = b->next)
        if (b->bin >= 0) {
            bin_remove(p, b);
            b->stream = stream;
            b->bin = NBINS; /* free, not binned: merged below */
        }
    b = p->last;
    while (b && b->prev)
        b = b->prev;
    while (b) {
        blk_t *n = b->next;
        if (b->bin == NBINS) {
            while (n && n->bin == NBINS) {
                b->size += n->size;
                unlink_blk(p, n);
                blk_t *nn = n->next;
                free(n);
                n = nn;
            }
            bin_insert(p, b);
        }
        b = n;
    }
}

/* Before a block of `stream` may enter the bins: room for the stream's
 * bins if it has none (see MAX_STREAM_BINS). */
static void make_room(pool_t *p, uintptr_t stream)
{
    if (p->nsb == MAX_STREAM_BINS && !bins_for(p, stream))
        merge_streams(p, stream);
}

/* Cut free block b (of the request's stream) down to `need` bytes; the rest
 * stays free in the bins. */
static int split(pool_t *p, blk_t *b, uint64_t need)
{
    bin_remove(p, b);
    if (b->size - need >= UMP_ALIGN) {
        blk_t *rest = blk_new(b->off + need, b->size - need, b->stream);
        if (!rest) {
            bin_insert(p, b);
            return UMP_ERR_NOMEM;
        }
        b->size = need;
        link_after(p, b, rest);
        bin_insert(p, rest);
    }
    return UMP_OK;
}

/* A block of `need` bytes cut at the end of what is in use. */
static int carve_tail(pool_t *p, uint64_t need, uintptr_t stream, uint64_t end, blk_t **out)
{
    uint64_t at = tail_start(p, stream);
    blk_t *b;
    if (at + need > end)
        return UMP_ERR_RANGE; /* blocks never move: live ones fill the range */
    if (at < p->top) {
        b = p->last; /* free but too small: it grows past top */
        bin_remove(p, b);
        b->size = need;
    } else {
        b = blk_new(at, need, stream);
        if (!b)
            return UMP_ERR_NOMEM;
        link_after(p, p->last, b);
    }
    p->top = at + need;
    *out = b;
    return UMP_OK;
}

/* Back a cut block with memory and list it live; on failure it goes back
 * to the bins. */
static int commit(pool_t *p, blk_t *b)
{
    int status = touch(p, b);
    if (status == UMP_OK) {
        status = live_insert(p, b);
        if (status != UMP_OK)
            untouch(p, b);
    }
    if (status != UMP_OK) {
        make_room(p, b->stream);
        release_blk(p, b);
        return status;
    }
    p->st.used_bytes += b->size;
    p->st.current_count++;
    p->st.total_bytes += b->size;
    p->st.total_count++;
    if (p->st.used_bytes > p->st.peak_used_bytes)
        p->st.peak_used_bytes = p->st.used_bytes;
    if (p->st.current_count > p->st.peak_count)
        p->st.peak_count = p->st.current_count;
    return UMP_OK;
}

int ump__block_alloc(pool_t *p, uint64_t size, uintptr_t stream, uintptr_t *ptr)
{
    uint64_t need = size ? (size + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN;
    uint64_t end = p->main.ngran * p->ph.gran;
    blk_t *b = find_fit(bins_for(p, stream), need);
    if (!b && tail_start(p, stream) + need > end) {
        merge_streams(p, stream);
        b = find_fit(bins_for(p, stream), need);
    }
    int status = b ? split(p, b, need) : carve_tail(p, need, stream, end, &b);
    if (status == UMP_OK) {
        b->stream = stream;
        status = commit(p, b);
    }
    if (status != UMP_OK) {
        p->st.failures++;
        return status;
    }
    *ptr = p->main.va + b->off;
    return UMP_OK;
}

int ump__block_free(pool_t *p, uintptr_t ptr)
{
    uint64_t off = ptr - p->main.va;
    size_t i = live_find(p, off);
    if (ptr < p->main.va || i == p->nlive || p->live[i]->off != off) {
        p->st.bad_frees++;
        return UMP_ERR_ARG;
    }
    blk_t *b = p->live[i];
    memmove(&p->live[i], &p->live[i + 1], (p->nlive - i - 1) * sizeof *p->live);
    p->nlive--;
    untouch(p, b);
    p->st.used_bytes -= b->size;
    p->st.current_count--;
    make_room(p, b->stream);
    release_blk(p, b);
    return UMP_OK;
}

blk_t *ump__block_below(pool_t *p, uint64_t off)
{
    size_t i = live_find(p, off + 1);
    return i ? p->live[i - 1] : NULL;
}

void ump__blocks_destroy(pool_t *p)
{
    blk_t *b = p->last;
    while (b) {
        blk_t *q = b->prev;
        free(b);
        b = q;
    }
    free(p->sb);
    free(p->live);
}
