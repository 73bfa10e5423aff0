/*
 * hooks.c - the NEP 49 hooks NumPy calls (through numpy_allocator), without
 * the GIL and on any thread: ump_malloc, ump_calloc, ump_realloc, ump_free.
 *
 * A block comes from this thread's cache, else the NumPy arena, else plain
 * memory (no arena, or it is full). A free goes back the same way, and a
 * pointer that is none of these is counted and left alone, never handed to
 * a free() that did not allocate it.
 */
#include "arenas.h"

#include <string.h>

static int numpy_arena = -1;

int ump_set_numpy_arena(int id)
{
    if (id != -1 && !ump__arena_get(id))
        return ump__set_status(UMP_ERR_ARG);
    __atomic_store_n(&numpy_arena, id, __ATOMIC_RELEASE);
    return UMP_OK;
}

int ump_get_numpy_arena(void) { return __atomic_load_n(&numpy_arena, __ATOMIC_ACQUIRE); }

static void *numpy_alloc(size_t size, size_t zero_bytes)
{
    arena_t *a = ump__arena_get(ump_get_numpy_arena());
    if (a && !ump__forked) {
        void *p = ump__tc_alloc(a, size);
        if (p) {
            if (zero_bytes)
                memset(p, 0, zero_bytes);
            return p;
        }
        p = ump__arena_alloc(a, size, zero_bytes);
        if (p)
            return p;
    }
    /* No arena, or it is full: plain memory, which NumPy uses as usual. */
    return ump__fallback_alloc(size, zero_bytes != 0);
}

void *ump_malloc(size_t size) { return numpy_alloc(size, 0); }

void *ump_calloc(size_t nmemb, size_t size)
{
    if (size && nmemb > SIZE_MAX / size) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t total = nmemb * size;
    return numpy_alloc(total, total ? total : 1);
}

void ump_free(void *ptr, size_t size)
{
    (void)size; /* NumPy's idea of the size; the registry knows the block's */
    if (!ptr)
        return;
    if (ump__tc_put(ptr))
        return;
    if (ump__arena_free(ptr) != NOT_IN_ARENA)
        return;
    if (ump__fallback_free(ptr))
        return;
    ump__foreign_free();
}

void *ump_realloc(void *ptr, size_t size)
{
    if (!ptr)
        return ump_malloc(size);
    if (size > SIZE_MAX - LARGE_GRAIN) {
        ump__set_status(UMP_ERR_ARG);
        return NULL;
    }
    size_t rsize = round_up(size ? size : 1, UMP_ALIGN);
    int in_place;
    size_t old = ump__arena_resize(ptr, rsize, &in_place);
    if (!old)
        old = ump__fallback_owned(ptr);
    if (!old) {
        ump__set_status(UMP_ERR_ARG); /* not a live ump block: leave it alone */
        return NULL;
    }
    if (in_place)
        return ptr;
    void *n = ump_malloc(size);
    if (!n)
        return NULL; /* the old block stays valid, as realloc promises */
    memcpy(n, ptr, old < rsize ? old : rsize);
    ump_free(ptr, old);
    return n;
}
