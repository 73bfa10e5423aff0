/*
 * lookup.c - ump_lookup: which live block holds a pointer. It asks the
 * owners of memory in turn, the arenas (registry.c) and the VMM pools (pool.c),
 * so neither needs to know of the other. Pool ids follow arena ids, so one
 * number names either owner.
 */
#include "internal.h"

int ump_lookup(uintptr_t p, uintptr_t *base, uint64_t *size, int *owner)
{
    uintptr_t b = 0;
    uint64_t s = 0;
    int id = -1;
    int kind = ump__arena_lookup(p, &b, &s, &id);
    if (kind == UMP_KIND_NONE) {
        kind = ump__vmm_lookup(p, &b, &s, &id);
        if (kind != UMP_KIND_NONE)
            id += UMP_MAX_ARENAS;
    }
    if (base)
        *base = b;
    if (size)
        *size = s;
    if (owner)
        *owner = id;
    return kind;
}
