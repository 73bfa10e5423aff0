/*
 * pool_race.c - a VMM pool destroyed while other threads use it, for
 * sanitizer builds (ASan, TSan). Each round creates a pool on the emulated
 * physical layer, starts threads that allocate, write, look up and free
 * blocks, read statistics, trim, create and destroy buffers and views (ring,
 * alias), and look up addresses in and out of the pool, and destroys the
 * pool from the main thread while they run. Every call on the pool must
 * either work or, once the pool is gone, fail with UMP_ERR_HANDLE; a call
 * that reached the pool just before it was destroyed must not touch its
 * freed state. Lookups go on until the pool is destroyed, and after, so that
 * some hold their pin across the destroy and free the slot themselves.
 * First, single-threaded, the ends of a pool's range (edges()).
 * Exits non-zero on any error.
 *
 * cc -fsanitize=thread -pthread csrc/{common,arena,cuda,vmm,lookup}.c tests/c/pool_race.c -ldl
 */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/ump.h"
#include "check.h"

enum { BLOCKS, STATE, VIEWS, LOOKUPS };
static const int roles[] = {BLOCKS, BLOCKS, STATE, VIEWS, VIEWS, LOOKUPS, LOOKUPS};
enum { RACERS = sizeof roles / sizeof *roles, WARMUP = 20, MiB = 1 << 20 };

static int pool;
static pthread_barrier_t warm; /* the racers' warm-up is over: destroy */
static int gate, parked;       /* holders wait at a shut gate; how many do */
static int destroyed;          /* set once ump_vmm_destroy succeeded: lookups stop */
static uintptr_t shown;        /* an address inside something live, or once live */
static long found, asked;      /* lookups of `shown` that found it, of all */

/* A failed call on the pool: only because the pool is gone. */
static int gone(void)
{
    CHECK(ump_last_status() == UMP_ERR_HANDLE);
    return 1;
}

/* Holders (of blocks, buffers, views) wait here, holding nothing, while the
 * main thread shuts the gate; it opens it just before a destroy. */
static void pass_gate(void)
{
    if (!__atomic_load_n(&gate, __ATOMIC_ACQUIRE))
        return;
    __atomic_fetch_add(&parked, 1, __ATOMIC_ACQ_REL);
    while (__atomic_load_n(&gate, __ATOMIC_ACQUIRE))
        sched_yield(); /* the racers may outnumber the cores */
    __atomic_fetch_sub(&parked, 1, __ATOMIC_ACQ_REL);
}

/* Show the lookup racers an address of something live; they may ask for it
 * long after it went. */
static void show(uintptr_t a) { __atomic_store_n(&shown, a, __ATOMIC_RELAXED); }

/* ump_lookup of a live block or region of the pool: exactly it. */
static void holds(uintptr_t a, uintptr_t base, uint64_t size)
{
    uintptr_t b;
    uint64_t s;
    int owner;
    CHECK(ump_lookup(a, &b, &s, &owner) == UMP_KIND_HOST);
    CHECK(b == base && s == size && owner == UMP_MAX_ARENAS + pool);
}

/* One buffer, ring or alias (by n), created, used, looked up and destroyed.
 * Once one exists destroy must refuse, so only creating it may find the pool
 * gone. Returns 0 then. */
static int view_cycle(int id, long n)
{
    uintptr_t va;
    uint64_t size;
    int v = -1;
    if (n % 3 == 0) { /* a buffer beside the main range, grown and shrunk */
        if (ump_vmm_buffer_create(id, 4 * MiB, &v) != UMP_OK && gone())
            return 0;
        CHECK(ump_vmm_buffer_resize(id, v, 3 * MiB) == UMP_OK);
        CHECK(ump_vmm_buffer_info(id, v, &va, &size) == UMP_OK && size == 3 * MiB);
        show(va + size - 1);
        ((unsigned char *)va)[size - 1] = 1;
        holds(va + size - 1, va, size);
        CHECK(ump_vmm_buffer_resize(id, v, MiB) == UMP_OK);
        CHECK(ump_vmm_buffer_destroy(id, v) == UMP_OK);
    } else if (n % 3 == 1) { /* one granule mapped twice */
        if (ump_vmm_ring_create(id, 2 * MiB, &v) != UMP_OK && gone())
            return 0;
        CHECK(ump_vmm_view_info(id, v, &va, &size, NULL, NULL) == UMP_OK && size == 4 * MiB);
        show(va + 3 * MiB);
        ((volatile unsigned char *)va)[7] = (unsigned char)n;
        CHECK(((volatile unsigned char *)va)[2 * MiB + 7] == (unsigned char)n);
        holds(va + 3 * MiB, va, size);
        CHECK(ump_vmm_view_destroy(id, v) == UMP_OK);
    } else { /* a block of the main range, and its alias */
        uintptr_t a = ump_vmm_alloc(id, MiB, 0), alias;
        if (!a && gone())
            return 0;
        memset((void *)a, (int)(n & 0x7f), MiB);
        CHECK(ump_vmm_alias_create(id, a + 4096, 4096, &alias, &v) == UMP_OK);
        CHECK(((volatile unsigned char *)alias)[0] == (n & 0x7f));
        CHECK(ump_vmm_view_info(id, v, &va, &size, NULL, NULL) == UMP_OK && alias >= va && alias < va + size);
        show(alias);
        holds(alias, va, size);
        CHECK(ump_vmm_view_destroy(id, v) == UMP_OK);
        CHECK(ump_vmm_free(id, a) == UMP_OK);
    }
    return 1;
}

/* Lookups until the pool was destroyed, and one after: of an address that is
 * no ump memory, always none; of `shown`, either what holds it now (in the
 * pool, and wholly around it) or none, and none once the pool is destroyed. */
static void *looker(void *arg)
{
    (void)arg;
    int local = 0;
    for (long n = 0;; n++) {
        if (n == WARMUP)
            pthread_barrier_wait(&warm);
        int after = __atomic_load_n(&destroyed, __ATOMIC_ACQUIRE);
        CHECK(ump_lookup((uintptr_t)&local, NULL, NULL, NULL) == UMP_KIND_NONE);
        uintptr_t a = __atomic_load_n(&shown, __ATOMIC_RELAXED), base = 1;
        uint64_t size = 1;
        int owner = 0;
        int kind = ump_lookup(a, &base, &size, &owner);
        if (kind == UMP_KIND_NONE) {
            CHECK(base == 0 && size == 0 && owner == -1);
        } else {
            CHECK(!after && kind == UMP_KIND_HOST && owner == UMP_MAX_ARENAS + pool);
            CHECK(base <= a && a - base < size && size % UMP_ALIGN == 0);
            __atomic_fetch_add(&found, 1, __ATOMIC_RELAXED);
        }
        __atomic_fetch_add(&asked, 1, __ATOMIC_RELAXED);
        if (after)
            return NULL;
        sched_yield(); /* leave the cores to the others now and then */
    }
}

/* A warm-up first, so that the pool holds handles, bins and regions when it
 * is destroyed; then the race, where only blocks, buffers and views are ever
 * live, and briefly. */
static void *racer(void *arg)
{
    int role = roles[(uintptr_t)arg];
    int id = pool;
    if (role == LOOKUPS)
        return looker(arg);
    for (long n = 0;; n++) {
        if (n == WARMUP)
            pthread_barrier_wait(&warm);
        if ((role == BLOCKS || role == VIEWS) && n > WARMUP)
            pass_gate();
        if (role == BLOCKS) { /* while one is live, destroy must refuse */
            uint64_t size = 512 + (uint64_t)(n % 7) * 300000;
            uintptr_t a = ump_vmm_alloc(id, size, (uintptr_t)arg);
            if (!a && gone())
                return NULL;
            memset((void *)a, 0x5a, 512);
            show(a + size - 1);
            holds(a + size - 1, a, (size + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN);
            CHECK(ump_vmm_free(id, a) == UMP_OK);
        } else if (role == STATE) { /* state read and changed under the pool's lock */
            ump_vmm_stats_t st;
            uintptr_t va;
            uint64_t size;
            if (ump_vmm_stats(id, &st) != UMP_OK && gone())
                return NULL;
            if (ump_vmm_trim(id, (int)(n & 1)) != UMP_OK && gone())
                return NULL;
            /* the region list, where a closed region is none: a bad argument */
            int s = ump_vmm_buffer_info(id, (int)(n % 3), &va, &size);
            if (s != UMP_OK && s != UMP_ERR_ARG && gone())
                return NULL;
        } else if (!view_cycle(id, n)) {
            CHECK(n >= WARMUP); /* nothing is destroyed before the warm-up ends */
            return NULL;
        }
    }
}

static void round_trip(void)
{
    CHECK(ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, (uint64_t)1 << 30, 0, &pool) == UMP_OK);
    __atomic_store_n(&destroyed, 0, __ATOMIC_RELAXED);
    show(0);
    pthread_t t[RACERS];
    int holders = 0;
    for (long i = 0; i < RACERS; i++) {
        holders += roles[i] == BLOCKS || roles[i] == VIEWS;
        CHECK(pthread_create(&t[i], NULL, racer, (void *)(uintptr_t)i) == 0);
    }
    pthread_barrier_wait(&warm);
    /* Refused while a racer holds a block, buffer or view. Every other try
     * first waits until the holders hold nothing, then lets them go on just
     * before it: they race to create things against a destroy that can work.
     * No try takes the pool's lock from the racers while it waits. */
    for (int tries = 0;; tries++) {
        if (tries & 1) {
            __atomic_store_n(&gate, 1, __ATOMIC_RELEASE);
            while (__atomic_load_n(&parked, __ATOMIC_ACQUIRE) < holders)
                sched_yield();
            __atomic_store_n(&gate, 0, __ATOMIC_RELEASE);
        }
        if (ump_vmm_destroy(pool) == UMP_OK)
            break;
        CHECK(ump_last_status() == UMP_ERR_ARG);
    }
    __atomic_store_n(&destroyed, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < RACERS; i++)
        pthread_join(t[i], NULL);

    /* The id of a destroyed pool names no pool: every call says so. */
    ump_vmm_stats_t st;
    uintptr_t va;
    uint64_t size;
    CHECK(ump_vmm_alloc(pool, 512, 0) == 0 && ump_last_status() == UMP_ERR_HANDLE);
    CHECK(ump_vmm_free(pool, 4096) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_stats(pool, &st) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_trim(pool, 0) == UMP_ERR_HANDLE);
    int v = -1;
    CHECK(ump_vmm_buffer_create(pool, MiB, &v) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_buffer_info(pool, 0, &va, &size) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_ring_create(pool, 2 * MiB, &v) == UMP_ERR_HANDLE && v == -1);
    CHECK(ump_vmm_view_info(pool, 0, &va, &size, NULL, NULL) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_view_destroy(pool, 0) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_destroy(pool) == UMP_ERR_HANDLE);
    CHECK(ump_lookup(__atomic_load_n(&shown, __ATOMIC_RELAXED), NULL, NULL, NULL) == UMP_KIND_NONE);
    /* The next pool made in the same slot has another id: the old one
     * still names nothing. */
    int next = -1;
    CHECK(ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, (uint64_t)1 << 30, 0, &next) == UMP_OK);
    CHECK(next != pool && next % UMP_MAX_POOLS == pool % UMP_MAX_POOLS);
    CHECK(ump_vmm_stats(pool, &st) == UMP_ERR_HANDLE && ump_vmm_destroy(pool) == UMP_ERR_HANDLE);
    uintptr_t b = ump_vmm_alloc(next, 4096, 0), lb;
    int owner;
    CHECK(b && ump_lookup(b, &lb, NULL, &owner) == UMP_KIND_HOST && owner == UMP_MAX_ARENAS + next);
    CHECK(ump_vmm_free(next, b) == UMP_OK && ump_vmm_destroy(next) == UMP_OK);
    /* An id no pool can have is a bad argument, not a stale handle. */
    CHECK(ump_vmm_stats(-1, &st) == UMP_ERR_ARG);
    CHECK(ump_vmm_stats(INT_MAX, &st) == UMP_ERR_ARG);
}

/* A free last block grows into the unused rest of the range; a full range
 * is UMP_ERR_RANGE, not the limit's UMP_ERR_CAP; a size that wraps past the
 * end of the address space is refused before a granule is read. */
static void edges(void)
{
    int p = -1, dev = -1;
    CHECK(ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, 64 * MiB, 0, &p) == UMP_OK);
    uintptr_t a = ump_vmm_alloc(p, 32 * MiB, 0);
    CHECK(a && ump_vmm_free(p, a) == UMP_OK);
    uintptr_t b = ump_vmm_alloc(p, 48 * MiB, 0);
    CHECK(b == a);
    CHECK(ump_vmm_alloc(p, 32 * MiB, 0) == 0 && ump_last_status() == UMP_ERR_RANGE);
    CHECK(ump_vmm_device_of(p, b, UINT64_MAX, &dev) == UMP_ERR_ARG);
    CHECK(ump_vmm_device_of(p, b + 4096, UINT64_MAX - 4095, &dev) == UMP_ERR_ARG);
    CHECK(ump_vmm_migrate(p, b, UINT64_MAX, 0) == UMP_ERR_ARG);
    CHECK(ump_vmm_device_of(p, b, 48 * MiB, &dev) == UMP_OK && dev == 0);
    CHECK(ump_vmm_free(p, b) == UMP_OK && ump_vmm_destroy(p) == UMP_OK);
}

int main(int argc, char **argv)
{
    edges();
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    CHECK(pthread_barrier_init(&warm, NULL, RACERS + 1) == 0);
    for (long r = 0; r < rounds; r++)
        round_trip();
    printf("pool race: %ld rounds\n", rounds);
    printf("lookups: %ld of a pool's address, %ld found it live\nOK\n", asked, found);
    return 0;
}
