/*
 * pool_race.c - a VMM pool destroyed while other threads use it, for
 * sanitizer builds (ASan, TSan). Each round creates a pool on the emulated
 * physical layer, starts threads that allocate, write, look up and free
 * blocks, read statistics, trim, and look for buffers, and destroys the pool
 * from the main thread while they run. Every call on the pool must either
 * work or, once the pool is gone, fail with UMP_ERR_HANDLE; a call that
 * reached the pool just before it was destroyed must not touch its freed
 * state. Exits non-zero on any error.
 *
 * cc -fsanitize=thread -pthread csrc/{common,arena,cuda,vmm,lookup}.c tests/c/pool_race.c -ldl
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/ump.h"
#include "check.h"

enum { RACERS = 6, WARMUP = 20 };

static int pool;
static pthread_barrier_t warm; /* the racers' warm-up is over: destroy */
static long frees;             /* blocks freed so far */

/* A failed call on the pool: only because the pool is gone. */
static int gone(void)
{
    CHECK(ump_last_status() == UMP_ERR_HANDLE);
    return 1;
}

/* A warm-up first, so that the pool holds handles, bins and regions when it
 * is destroyed; then the race, where only blocks are ever live, and briefly. */
static void *racer(void *arg)
{
    long role = (long)(uintptr_t)arg % 3;
    int id = pool;
    for (long n = 0;; n++) {
        if (n == WARMUP)
            pthread_barrier_wait(&warm);
        if (role == 0) { /* blocks: while one is live, destroy must refuse */
            uint64_t size = 512 + (uint64_t)(n % 7) * 300000;
            uintptr_t a = ump_vmm_alloc(id, size, (uintptr_t)arg);
            if (!a && gone())
                return NULL;
            memset((void *)a, 0x5a, 512);
            uintptr_t base;
            CHECK(ump_lookup(a, &base, NULL, NULL) == UMP_KIND_HOST && base == a);
            CHECK(ump_vmm_free(id, a) == UMP_OK);
            __atomic_fetch_add(&frees, 1, __ATOMIC_RELAXED);
        } else if (role == 1) { /* state read and changed under the pool's lock */
            ump_vmm_stats_t st;
            if (ump_vmm_stats(id, &st) != UMP_OK && gone())
                return NULL;
            if (ump_vmm_trim(id, (int)(n & 1)) != UMP_OK && gone())
                return NULL;
        } else if (n < WARMUP) { /* regions beside the main range */
            int buf = ump_vmm_buffer_create(id, 4 << 20);
            CHECK(buf >= 0);
            uintptr_t va;
            uint64_t size;
            CHECK(ump_vmm_buffer_resize(id, buf, 3 << 20) == UMP_OK);
            CHECK(ump_vmm_buffer_info(id, buf, &va, &size) == UMP_OK && size == 3 << 20);
            ((unsigned char *)va)[size - 1] = 1;
            CHECK(ump_vmm_buffer_destroy(id, buf) == UMP_OK);
        } else { /* the region list, where a closed buffer is no buffer */
            uintptr_t va;
            uint64_t size;
            if (ump_vmm_buffer_info(id, 0, &va, &size) != UMP_ERR_ARG && gone())
                return NULL;
        }
    }
}

static void round_trip(void)
{
    pool = ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, (uint64_t)1 << 30, 0);
    CHECK(pool >= 0);
    pthread_t t[RACERS];
    for (long i = 0; i < RACERS; i++)
        CHECK(pthread_create(&t[i], NULL, racer, (void *)(uintptr_t)i) == 0);
    pthread_barrier_wait(&warm);
    /* Refused while a racer holds a block; try again once one was freed,
     * rather than take the pool's lock from the racers meanwhile. */
    for (;;) {
        long seen = __atomic_load_n(&frees, __ATOMIC_RELAXED);
        if (ump_vmm_destroy(pool) == UMP_OK)
            break;
        CHECK(ump_last_status() == UMP_ERR_ARG);
        while (__atomic_load_n(&frees, __ATOMIC_RELAXED) == seen)
            sched_yield(); /* the racers may outnumber the cores */
    }
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
    CHECK(ump_vmm_buffer_info(pool, 0, &va, &size) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_view_destroy(pool, 0) == UMP_ERR_HANDLE);
    CHECK(ump_vmm_destroy(pool) == UMP_ERR_HANDLE);
    /* An id no pool can have is a bad argument, not a stale handle. */
    CHECK(ump_vmm_stats(-1, &st) == UMP_ERR_ARG);
    CHECK(ump_vmm_stats(UMP_MAX_POOLS, &st) == UMP_ERR_ARG);
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    CHECK(pthread_barrier_init(&warm, NULL, RACERS + 1) == 0);
    for (long r = 0; r < rounds; r++)
        round_trip();
    printf("pool race: %ld rounds\nOK\n", rounds);
    return 0;
}
