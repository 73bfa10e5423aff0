/*
 * ctx_race.c - ump's CUDA context and device changed (enable() on another
 * device) while other threads make and free managed chunks, whose provider
 * calls push that context and advise that device. Both were plain globals:
 * ThreadSanitizer reported the race. The driver is tests/c/stub_cuda.c
 * (path in UMP_TEST_LIBCUDA), so this runs without a GPU.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../csrc/ump.h"
#include "check.h"

enum { THREADS = 3 };
static long rounds = 2000;
static int arena, running = 1;

static void *setter(void *arg)
{
    (void)arg;
    for (uintptr_t i = 0; __atomic_load_n(&running, __ATOMIC_RELAXED); i++)
        CHECK(ump_cuda_set_context(0x1000 + 0x100 * (i % 4), (int)(i % 4)) == UMP_OK);
    return NULL;
}

static void *chunk_maker(void *arg)
{
    (void)arg;
    for (long r = 0; r < rounds; r++) {
        /* Past the slabs: a run of its own, from a new chunk once trimmed. */
        void *p = ump_arena_alloc(arena, (size_t)3 << 20);
        CHECK(p);
        ((volatile char *)p)[0] = 1;
        CHECK(ump_arena_free(p) == UMP_OK);
        CHECK(ump_arena_trim(arena) == UMP_OK);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = atol(argv[1]);
    const char *lib = getenv("UMP_TEST_LIBCUDA");
    CHECK(lib && ump_cuda_load(lib) == UMP_OK);
    CHECK(ump_cuda_set_context(0x1000, 0) == UMP_OK);
    CHECK(ump_arena_create(UMP_KIND_MANAGED, UMP_PROVIDER_MANAGED, (uint64_t)1 << 30,
                           UMP_ARENA_ADVISE_HOST, -1, 0, &arena) == UMP_OK);
    pthread_t set, make[THREADS];
    CHECK(pthread_create(&set, NULL, setter, NULL) == 0);
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_create(&make[i], NULL, chunk_maker, NULL) == 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(make[i], NULL);
    __atomic_store_n(&running, 0, __ATOMIC_RELAXED);
    pthread_join(set, NULL);
    ump_stats_t st;
    CHECK(ump_arena_stats(arena, &st) == UMP_OK && st.current_count == 0);
    CHECK(st.chunk_allocs > 0 && st.chunk_frees == st.chunk_allocs);
    printf("context race: %ld rounds x %d threads, %llu chunks\nOK\n", rounds, THREADS,
           (unsigned long long)st.chunk_allocs);
    return 0;
}
