/*
 * registry.c - which arena chunk holds a pointer: a sorted array of chunks
 * under a reader/writer lock, searched in O(log chunks). ump_lookup and every
 * free go through it, so a pointer ump did not allocate, or a block freed
 * twice, is recognised without reading memory around it.
 */
#include "arenas.h"

#include <stdlib.h>
#include <string.h>

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
uint64_t ump__reg_generation;
static chunk_t **reg;
static size_t reg_n, reg_cap;
static uint64_t foreign_frees;

void ump__reg_read(void) { pthread_rwlock_rdlock(&reg_lock); }
void ump__reg_write(void) { pthread_rwlock_wrlock(&reg_lock); }
void ump__reg_done(void) { pthread_rwlock_unlock(&reg_lock); }

uint64_t ump_foreign_frees(void) { return __atomic_load_n(&foreign_frees, __ATOMIC_RELAXED); }
void ump__foreign_free(void) { __atomic_fetch_add(&foreign_frees, 1, __ATOMIC_RELAXED); }

/* Index of the last chunk whose base <= p, or -1. Caller holds reg_lock. */
static long reg_floor(uintptr_t p)
{
    long lo = 0, hi = (long)reg_n - 1, ans = -1;
    while (lo <= hi) {
        long mid = lo + (hi - lo) / 2;
        if (reg[mid]->base <= p) {
            ans = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return ans;
}

chunk_t *ump__reg_find(uintptr_t p)
{
    long i = reg_floor(p);
    if (i < 0)
        return NULL;
    chunk_t *c = reg[i];
    return p < c->base + c->size ? c : NULL;
}

int ump__reg_insert(chunk_t *c)
{
    if (reg_n == reg_cap) {
        size_t ncap = reg_cap ? reg_cap * 2 : 64;
        chunk_t **n = realloc(reg, ncap * sizeof *n);
        if (!n)
            return UMP_ERR_NOMEM;
        reg = n;
        reg_cap = ncap;
    }
    long at = reg_floor(c->base) + 1;
    memmove(&reg[at + 1], &reg[at], (reg_n - (size_t)at) * sizeof *reg);
    reg[at] = c;
    reg_n++;
    return UMP_OK;
}

void ump__reg_remove(chunk_t *c)
{
    __atomic_fetch_add(&ump__reg_generation, 1, __ATOMIC_RELEASE);
    long i = reg_floor(c->base);
    if (i >= 0 && reg[i] == c) {
        memmove(&reg[i], &reg[i + 1], (reg_n - (size_t)i - 1) * sizeof *reg);
        reg_n--;
    }
}

int ump__arena_lookup(uintptr_t p, uintptr_t *base, uint64_t *size, int *arena)
{
    int kind = UMP_KIND_NONE;
    pthread_rwlock_rdlock(&reg_lock);
    chunk_t *c = ump__reg_find(p);
    if (c) {
        uintptr_t b = 0;
        uint64_t s = 0;
        if (c->cls >= 0) {
            uint32_t idx = (uint32_t)((p - c->base) / c->block);
            uint64_t word = __atomic_load_n(&c->live[idx / 64], __ATOMIC_RELAXED);
            if (word & ((uint64_t)1 << (idx % 64))) {
                b = c->base + (uintptr_t)idx * c->block;
                s = c->block;
            }
        } else if (__atomic_load_n(&c->in_use, __ATOMIC_RELAXED) &&
                   p < c->base + c->used) {
            b = c->base;
            s = c->used;
        }
        if (s) {
            kind = c->arena->kind;
            *base = b;
            *size = s;
            *arena = c->arena->id;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
    return kind;
}

/* --- fork: held across fork() (rank UMP_FORK_REGISTRY) -------------------- */

static void fork_prepare(void) { pthread_rwlock_wrlock(&reg_lock); }
static void fork_parent(void) { pthread_rwlock_unlock(&reg_lock); }

/* glibc's rwlock remembers the writer's thread id, which differs in the
 * child: unlocking would corrupt it. The child has one thread and no other
 * holder, so a fresh lock is exact. */
static void fork_child(void) { pthread_rwlock_init(&reg_lock, NULL); }

__attribute__((constructor)) static void registry_init(void)
{
    ump__on_fork(UMP_FORK_REGISTRY, fork_prepare, fork_parent, fork_child);
}
