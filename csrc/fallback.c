/*
 * fallback.c - plain aligned memory, for NumPy's blocks while no arena is
 * active or the arena is full. The blocks are kept in a hash set so that
 * free() recognises them without reading memory in front of a pointer that
 * may not be ours.
 *
 * A zeroed block of FALLBACK_MAP_MIN bytes or more is fresh anonymous
 * pages (page aligned, so 512-byte aligned): the kernel hands out zero pages
 * and commits memory only where the array is written, as NumPy's own
 * calloc does. posix_memalign + memset would commit all of it at once
 * (np.zeros of 2 GiB: a second and 2 GiB of RSS).
 */
#include "arenas.h"

#include <stdlib.h>
#include <string.h>

#define FALLBACK_MAP_MIN ((size_t)64 << 10)

typedef struct { uintptr_t key; size_t size; int mapped; } fb_slot;

static pthread_mutex_t fb_lock = PTHREAD_MUTEX_INITIALIZER;
static fb_slot *fb_tab;
static size_t fb_cap, fb_n;
static ump_stats_t fb_st;

static size_t fb_hash(uintptr_t k, size_t cap)
{
    uint64_t h = (uint64_t)k * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20) & (cap - 1);
}

static int fb_grow(void)
{
    size_t ncap = fb_cap ? fb_cap * 2 : 1024;
    fb_slot *n = calloc(ncap, sizeof *n);
    if (!n)
        return UMP_ERR_NOMEM;
    for (size_t i = 0; i < fb_cap; i++) {
        if (!fb_tab[i].key)
            continue;
        size_t j = fb_hash(fb_tab[i].key, ncap);
        while (n[j].key)
            j = (j + 1) & (ncap - 1);
        n[j] = fb_tab[i];
    }
    free(fb_tab);
    fb_tab = n;
    fb_cap = ncap;
    return UMP_OK;
}

/* Caller holds fb_lock. Index of k, or of the empty slot where it would go. */
static size_t fb_find(uintptr_t k)
{
    size_t i = fb_hash(k, fb_cap);
    while (fb_tab[i].key && fb_tab[i].key != k)
        i = (i + 1) & (fb_cap - 1);
    return i;
}

/* Linear-probing delete with backward shift: no tombstones. */
static void fb_delete_at(size_t i)
{
    size_t j = i;
    for (;;) {
        fb_tab[i].key = 0;
        for (;;) {
            j = (j + 1) & (fb_cap - 1);
            if (!fb_tab[j].key)
                return;
            size_t h = fb_hash(fb_tab[j].key, fb_cap);
            /* can the entry at j move to i? */
            if (i <= j ? (i < h && h <= j) : (i < h || h <= j))
                continue;
            break;
        }
        fb_tab[i] = fb_tab[j];
        i = j;
    }
}

/* rsize bytes, 512-byte aligned; zero-filled if `zero`. */
static void *fb_take(size_t rsize, int zero, int *mapped)
{
    *mapped = zero && rsize >= FALLBACK_MAP_MIN;
    if (*mapped) {
        void *p;
        int fresh_zero;
        return ump__provider_alloc(UMP_PROVIDER_HOST, rsize, &p, &fresh_zero, NULL) == UMP_OK ? p : NULL;
    }
    void *p = NULL;
    if (posix_memalign(&p, UMP_ALIGN, rsize) != 0)
        return NULL;
    if (zero)
        memset(p, 0, rsize);
    return p;
}

static void fb_give(void *p, size_t rsize, int mapped)
{
    if (mapped)
        ump__provider_free(UMP_PROVIDER_HOST, p, rsize, NULL);
    else
        free(p);
}

void *ump__fallback_alloc(size_t size, int zero)
{
    if (size > SIZE_MAX - UMP_ALIGN) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t rsize = round_up(size ? size : 1, UMP_ALIGN);
    int mapped;
    void *p = fb_take(rsize, zero, &mapped);
    if (!p) {
        ump__set_status(UMP_ERR_NOMEM);
        return NULL;
    }
    pthread_mutex_lock(&fb_lock);
    if ((fb_n + 1) * 2 > fb_cap && fb_grow() != UMP_OK) {
        pthread_mutex_unlock(&fb_lock);
        fb_give(p, rsize, mapped);
        ump__set_status(UMP_ERR_NOMEM);
        return NULL;
    }
    size_t i = fb_find((uintptr_t)p);
    fb_tab[i].key = (uintptr_t)p;
    fb_tab[i].size = rsize;
    fb_tab[i].mapped = mapped;
    fb_n++;
    st_alloc(&fb_st, rsize, 0, 0);
    pthread_mutex_unlock(&fb_lock);
    return p;
}

size_t ump__fallback_owned(void *p)
{
    size_t size = 0;
    pthread_mutex_lock(&fb_lock);
    if (fb_cap) {
        size_t i = fb_find((uintptr_t)p);
        if (fb_tab[i].key)
            size = fb_tab[i].size;
    }
    pthread_mutex_unlock(&fb_lock);
    return size;
}

int ump__fallback_free(void *p)
{
    size_t size = 0;
    int mapped = 0;
    pthread_mutex_lock(&fb_lock);
    if (fb_cap) {
        size_t i = fb_find((uintptr_t)p);
        if (fb_tab[i].key) {
            size = fb_tab[i].size;
            mapped = fb_tab[i].mapped;
            fb_delete_at(i);
            fb_n--;
            st_free(&fb_st, size);
        }
    }
    pthread_mutex_unlock(&fb_lock);
    if (size)
        fb_give(p, size, mapped);
    return size != 0;
}

int ump_fallback_stats(ump_stats_t *out)
{
    if (!out)
        return ump__set_status(UMP_ERR_ARG);
    pthread_mutex_lock(&fb_lock);
    *out = fb_st;
    pthread_mutex_unlock(&fb_lock);
    return UMP_OK;
}

/* --- fork: held across fork() (rank UMP_FORK_FALLBACK) -------------------- */

static void fork_prepare(void) { pthread_mutex_lock(&fb_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&fb_lock); }
static void fork_child(void) { pthread_mutex_init(&fb_lock, NULL); }

__attribute__((constructor)) static void fallback_init(void)
{
    ump__on_fork(UMP_FORK_FALLBACK, fork_prepare, fork_parent, fork_child);
}
