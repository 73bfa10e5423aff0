/*
 * arena_race.c - races of the arenas' lock-free paths, for sanitizer builds
 * (ASan, UBSan, TSan). Each phase sets up one race many times over:
 *  1. a free through the thread cache while another thread trims the slab a
 *     cache hint names (the hint's chunk_t used to be read after the trim
 *     freed it: a use-after-free under ASan);
 *  2. one block freed by two threads at once, one through its thread cache,
 *     the other through the locked path: exactly one free may succeed;
 *  3. two threads making a provider call while one injected failure is
 *     left: exactly one may fail, and no call after;
 *  4. statistics of an arena churned through thread caches, read while the
 *     churn runs: totals count every allocation, current ones none at the end.
 * Exits non-zero on any error. Arguments: the rounds, and the phases to run.
 *
 * cc -fsanitize=address,undefined -pthread csrc/{common,arena,cuda,vmm,lookup}.c tests/c/arena_race.c -ldl
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../csrc/ump.h"
#include "check.h"

enum { THREADS = 4 };
static long rounds = 100000;

/* A fresh arena per phase (devices no other arena uses): its own budget. */
static int fresh_arena(int device)
{
    int a = -1;
    CHECK(ump_arena_create(UMP_KIND_HOST, UMP_PROVIDER_HOST, (uint64_t)1 << 32, 0, device, 0, &a) ==
          UMP_OK);
    return a;
}

static void spin(unsigned n)
{
    for (volatile unsigned i = 0; i < n; i++)
        ;
}

/* The threads of a phase start each round together. */
typedef struct { int n, waiting, phase; } barrier_t;

static void barrier_wait(barrier_t *b)
{
    int phase = __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->waiting, 1, __ATOMIC_ACQ_REL) == b->n) {
        __atomic_store_n(&b->waiting, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->phase, phase + 1, __ATOMIC_RELEASE);
    } else {
        for (int spins = 0; __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE) == phase; spins++)
            if (spins > 100000)
                sched_yield(); /* the others may wait for a CPU */
    }
}

/* --- 1. cache hints against trim ----------------------------------------- */

static int arena;
static int stop;

/* Both threads on one CPU: the race needs the worker to lose the CPU between
 * the generation check and the hint walk, and the trimmer to run then. */
static void same_cpu(void)
{
    cpu_set_t set;
    CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &set)) {
            CPU_ZERO(&set);
            CPU_SET(cpu, &set);
            CHECK(pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0);
            return;
        }
}

static void *trimmer(void *arg)
{
    (void)arg;
    same_cpu();
    while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
        CHECK(ump_arena_trim(arena) == UMP_OK);
        usleep(20); /* waking up, it preempts the worker wherever it is */
    }
    return NULL;
}

/* Empty a slab of 1 KiB blocks, which a cache hint still names, then free a
 * 2 KiB block through the cache: the hint walk passes the emptied slab while
 * the trimmer frees it. */
static void *hint_worker(void *arg)
{
    (void)arg;
    same_cpu();
    void *keep = ump_malloc(2048); /* keeps the cached block's slab */
    for (long i = 0; i < rounds * 10; i++) {
        void *p = ump_malloc(1024);
        CHECK(p);
        CHECK(ump_arena_free(p) == UMP_OK); /* the locked path: the slab is wholly free */
        void *q = ump_malloc(2048);
        CHECK(q);
        ump_free(q, 2048);
    }
    ump_free(keep, 2048);
    return NULL;
}

static void hint_against_trim(void)
{
    arena = fresh_arena(40);
    CHECK(ump_set_numpy_arena(arena) == UMP_OK);
    pthread_t worker, trim;
    CHECK(pthread_create(&trim, NULL, trimmer, NULL) == 0);
    CHECK(pthread_create(&worker, NULL, hint_worker, NULL) == 0);
    pthread_join(worker, NULL);
    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
    pthread_join(trim, NULL);
    ump_stats_t st;
    CHECK(ump_arena_stats(arena, &st) == UMP_OK && st.current_count == 0);
    printf("hints: %ld rounds, %llu chunks trimmed\n", rounds * 10,
           (unsigned long long)st.chunk_frees);
}

/* --- 2. one block freed twice at once ------------------------------------ */

static barrier_t pair = {2, 0, 0};
static void *shared_block;
static int lock_freed;

/* The block's owner: it allocates through its cache, so its free goes to the
 * cache; a sweeping delay moves its free across the other thread's. Only
 * these two threads free in this phase, and a refused free counts as a
 * foreign one: one a round. */
static void *cache_freer(void *arg)
{
    (void)arg;
    for (long i = 0; i < rounds; i++) {
        void *p = ump_malloc(1024);
        CHECK(p);
        __atomic_store_n(&shared_block, p, __ATOMIC_RELAXED);
        uint64_t before = ump_foreign_frees();
        barrier_wait(&pair);
        spin((unsigned)(i % 1024));
        ump_free(p, 1024);
        barrier_wait(&pair);
        CHECK(ump_foreign_frees() - before == 1); /* 0: the block was freed twice */
    }
    return NULL;
}

static void *lock_freer(void *arg)
{
    (void)arg;
    for (long i = 0; i < rounds; i++) {
        barrier_wait(&pair);
        if (ump_arena_free(__atomic_load_n(&shared_block, __ATOMIC_RELAXED)) == UMP_OK)
            lock_freed++;
        barrier_wait(&pair);
    }
    return NULL;
}

static void double_free_race(void)
{
    arena = fresh_arena(41);
    CHECK(ump_set_numpy_arena(arena) == UMP_OK);
    pthread_t a, b;
    CHECK(pthread_create(&a, NULL, cache_freer, NULL) == 0);
    CHECK(pthread_create(&b, NULL, lock_freer, NULL) == 0);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    ump_stats_t st;
    CHECK(ump_arena_stats(arena, &st) == UMP_OK && st.current_count == 0);
    printf("double frees: %ld rounds, %ld won by the cache\n", rounds, rounds - lock_freed);
}

/* --- 3. the last injected failure ---------------------------------------- */

static barrier_t callers = {2, 0, 0};
static pthread_barrier_t round_start, round_end;
static int injected;

/* Two threads make a provider call at once, one a little later each round. */
static void *provider_caller(void *arg)
{
    for (long i = 0; i < rounds / 10; i++) {
        pthread_barrier_wait(&round_start);
        barrier_wait(&callers);
        if (arg)
            spin((unsigned)(i % 1024));
        void *p = ump_arena_alloc(arena, 1 << 20 | 1); /* a run of its own: a provider call */
        if (!p) {
            CHECK(ump_last_status() == UMP_ERR_INJECTED);
            __atomic_fetch_add(&injected, 1, __ATOMIC_RELAXED);
        } else {
            CHECK(ump_arena_free(p) == UMP_OK);
        }
        pthread_barrier_wait(&round_end);
    }
    return NULL;
}

static void injection_race(void)
{
    arena = fresh_arena(42);
    pthread_t t[2];
    CHECK(pthread_barrier_init(&round_start, NULL, 3) == 0 && pthread_barrier_init(&round_end, NULL, 3) == 0);
    for (long i = 0; i < 2; i++)
        CHECK(pthread_create(&t[i], NULL, provider_caller, (void *)i) == 0);
    for (long i = 0; i < rounds / 10; i++) {
        CHECK(ump_arena_trim(arena) == UMP_OK); /* no cached run: both call the provider */
        ump_fault_inject(0, 1);
        pthread_barrier_wait(&round_start);
        pthread_barrier_wait(&round_end);
        CHECK(injected == 1); /* 2: both took the last failure, and left -1: fail forever */
        injected = 0;
        void *p = ump_arena_alloc(arena, 5 << 20); /* nothing left to inject */
        CHECK(p && ump_arena_free(p) == UMP_OK);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&round_start);
    pthread_barrier_destroy(&round_end);
    ump_fault_inject(0, 0);
    printf("injection: %ld rounds\n", rounds / 10);
}

/* --- 4. statistics of thread caches --------------------------------------- */

static long allocations;

static void *churner(void *arg)
{
    uint64_t s = 0x9E3779B97F4A7C15ull * ((uintptr_t)arg + 1);
    void *live[16] = {0};
    long mine = 0;
    for (long i = 0; i < rounds; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        void **slot = &live[s % 16];
        if (*slot) {
            ump_free(*slot, 0);
            *slot = NULL;
        } else {
            CHECK((*slot = ump_malloc((s >> 8) % 5000)) != NULL);
            mine++;
        }
    }
    for (int i = 0; i < 16; i++)
        ump_free(live[i], 0);
    __atomic_fetch_add(&allocations, mine, __ATOMIC_RELAXED);
    return NULL;
}

static void *stats_reader(void *arg)
{
    (void)arg;
    ump_stats_t st;
    while (!__atomic_load_n(&stop, __ATOMIC_RELAXED)) {
        CHECK(ump_arena_stats(arena, &st) == UMP_OK);
        CHECK(st.current_count <= 16 * THREADS && st.peak_count >= st.current_count);
    }
    return NULL;
}

static void cached_statistics(void)
{
    arena = fresh_arena(43);
    CHECK(ump_set_numpy_arena(arena) == UMP_OK);
    __atomic_store_n(&stop, 0, __ATOMIC_RELAXED);
    pthread_t t[THREADS], reader;
    CHECK(pthread_create(&reader, NULL, stats_reader, NULL) == 0);
    for (long i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, churner, (void *)i) == 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
    pthread_join(reader, NULL);
    ump_stats_t st;
    CHECK(ump_arena_stats(arena, &st) == UMP_OK);
    CHECK(st.total_count == (uint64_t)allocations);
    CHECK(st.current_count == 0 && st.current_bytes == 0);
    CHECK(st.peak_count >= 1);
    printf("statistics: %llu allocations, peak %llu blocks\n", (unsigned long long)st.total_count,
           (unsigned long long)st.peak_count);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = atol(argv[1]);
    const char *phases = argc > 2 ? argv[2] : "1234"; /* some, to debug them */
    if (strchr(phases, '1'))
        hint_against_trim();
    if (strchr(phases, '2'))
        double_free_race();
    if (strchr(phases, '3'))
        injection_race();
    if (strchr(phases, '4'))
        cached_statistics();
    CHECK(ump_set_numpy_arena(-1) == UMP_OK);
    printf("OK\n");
    return 0;
}
