/*
 * stress.c - drives the C core directly, for sanitizer builds (ASan, UBSan,
 * TSan). Threads allocate, reallocate and free blocks of mixed sizes through
 * the NumPy hooks, write a pattern into each and check it before freeing;
 * then the edge cases: overflow, foreign and double frees, the cap and its
 * fallback, injected provider failures, trim. Then the same for a VMM pool on
 * its emulated physical layer (memfd mappings): threads on two streams,
 * trims from another thread, buffers, a rolled-back mapping, migration.
 * Exits non-zero on any error.
 *
 * cc -fsanitize=address,undefined -pthread csrc/*.c (but module.c) tests/c/stress.c -ldl
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../csrc/ump.h"
#include "check.h"

enum { THREADS = 8, LIVE = 64 };
static long ops_per_thread = 200000;

typedef struct { unsigned char *p; size_t n; unsigned char tag; } block_t;

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static size_t pick_size(uint64_t *s)
{
    switch (rng_next(s) % 8) {
    case 0: return rng_next(s) % 64;
    case 1: case 2: return rng_next(s) % 4096;
    case 3: case 4: return rng_next(s) % 70000;
    case 5: return rng_next(s) % (1 << 20);
    case 6: return (1 << 20) + rng_next(s) % (3 << 20);
    default: return rng_next(s) % 600;
    }
}

static void fill(block_t *b) { if (b->n) { memset(b->p, b->tag, b->n < 256 ? b->n : 256); b->p[b->n - 1] = b->tag; } }

static void verify(const block_t *b)
{
    if (!b->n)
        return;
    size_t head = b->n < 256 ? b->n : 256;
    for (size_t i = 0; i < head; i++)
        CHECK(b->p[i] == b->tag);
    CHECK(b->p[b->n - 1] == b->tag);
}

static void *worker(void *arg)
{
    uint64_t s = 0x9E3779B97F4A7C15ull * (uintptr_t)arg + 1;
    block_t live[LIVE] = {{0}};
    for (long op = 0; op < ops_per_thread; op++) {
        block_t *b = &live[rng_next(&s) % LIVE];
        unsigned r = rng_next(&s) % 10;
        if (b->p && r < 4) {
            verify(b);
            ump_free(b->p, b->n);
            b->p = NULL;
        } else if (b->p && r < 6) {
            verify(b);
            size_t n = pick_size(&s);
            unsigned char *q = ump_realloc(b->p, n);
            CHECK(q && ((uintptr_t)q % UMP_ALIGN) == 0);
            size_t keep = n < b->n ? n : b->n;
            if (keep) {
                size_t head = keep < 256 ? keep : 256;
                for (size_t i = 0; i < head; i++)
                    CHECK(q[i] == b->tag);
            }
            b->p = q;
            b->n = n;
            fill(b);
        } else if (!b->p) {
            size_t n = pick_size(&s);
            b->p = (r & 1) ? ump_calloc(n, 1) : ump_malloc(n);
            CHECK(b->p && ((uintptr_t)b->p % UMP_ALIGN) == 0);
            if (r & 1)
                for (size_t i = 0; i < (n < 512 ? n : 512); i++)
                    CHECK(b->p[i] == 0);
            uintptr_t base;
            uint64_t size;
            int kind = ump_lookup((uintptr_t)b->p + (n ? n - 1 : 0), &base, &size, NULL);
            CHECK(kind == UMP_KIND_NONE || (base == (uintptr_t)b->p && size >= n));
            b->n = n;
            b->tag = (unsigned char)(rng_next(&s) | 1);
            fill(b);
        }
    }
    for (int i = 0; i < LIVE; i++)
        if (live[i].p) {
            verify(&live[i]);
            ump_free(live[i].p, live[i].n);
        }
    return NULL;
}

/* --- a refused free in one thread, good frees in others ------------------ */

static int arena;
static int bad_freeing;

static void *bad_freer(void *foreign)
{
    while (__atomic_load_n(&bad_freeing, __ATOMIC_RELAXED))
        ump_free(foreign, 64); /* refused and counted, every time */
    return NULL;
}

static void *good_freer(void *arg)
{
    (void)arg;
    for (long i = 0; i < ops_per_thread / 4; i++) {
        void *p = ump_arena_alloc(arena, 4096);
        CHECK(p);
        CHECK(ump_arena_free(p) == UMP_OK);
    }
    return NULL;
}

/* Whether a free was refused must come from the registry, not from the
 * count of refused frees, which other threads change at any moment. */
static void concurrent_bad_frees(void)
{
    char *foreign = malloc(64);
    pthread_t bad, good[THREADS - 1];
    __atomic_store_n(&bad_freeing, 1, __ATOMIC_RELAXED);
    CHECK(pthread_create(&bad, NULL, bad_freer, foreign) == 0);
    for (long i = 0; i < THREADS - 1; i++)
        CHECK(pthread_create(&good[i], NULL, good_freer, NULL) == 0);
    for (int i = 0; i < THREADS - 1; i++)
        pthread_join(good[i], NULL);
    __atomic_store_n(&bad_freeing, 0, __ATOMIC_RELAXED);
    pthread_join(bad, NULL);
    free(foreign);
}

/* --- VMM pool ------------------------------------------------------------ */

static int pool;

static void *pool_worker(void *arg)
{
    uint64_t s = 0x2545F4914F6CDD1Dull * ((uintptr_t)arg + 7);
    uintptr_t stream = (uintptr_t)arg % 2 + 1;
    block_t live[32] = {{0}};
    for (long op = 0; op < ops_per_thread / 8; op++) {
        block_t *b = &live[rng_next(&s) % 32];
        if (b->p) {
            verify(b);
            CHECK(ump_vmm_free(pool, (uintptr_t)b->p) == UMP_OK);
            b->p = NULL;
        } else {
            size_t n = rng_next(&s) % 16 == 0 ? rng_next(&s) % (6 << 20) : rng_next(&s) % 300000;
            b->p = (unsigned char *)ump_vmm_alloc(pool, n, stream);
            CHECK(b->p && (uintptr_t)b->p % UMP_ALIGN == 0);
            uintptr_t base;
            uint64_t size;
            CHECK(ump_lookup((uintptr_t)b->p + (n ? n - 1 : 0), &base, &size, NULL) == UMP_KIND_HOST);
            CHECK(base == (uintptr_t)b->p && size >= n);
            b->n = n;
            b->tag = (unsigned char)(rng_next(&s) | 1);
            fill(b);
        }
        if (op % 5000 == 0 && (uintptr_t)arg == 0)
            CHECK(ump_vmm_trim(pool, op % 10000 == 0) == UMP_OK);
    }
    for (int i = 0; i < 32; i++)
        if (live[i].p) {
            verify(&live[i]);
            CHECK(ump_vmm_free(pool, (uintptr_t)live[i].p) == UMP_OK);
        }
    return NULL;
}

/* Views made and taken apart while the workers allocate, free, scavenge and
 * trim around them: an alias must keep its chunks where they are. */
static void *view_worker(void *arg)
{
    (void)arg;
    const uint64_t g = 2 << 20;
    for (long op = 0; op < ops_per_thread / 400 + 1; op++) {
        uintptr_t blk = ump_vmm_alloc(pool, 3 * g, 9), alias;
        CHECK(blk);
        memset((void *)blk, 0x11, 3 * g);
        int v = -1;
        CHECK(ump_vmm_alias_create(pool, blk + 1000, 2 * g, &alias, &v) == UMP_OK && v >= 0);
        CHECK(((unsigned char *)alias)[2 * g - 1] == 0x11);
        ((unsigned char *)alias)[0] = 0x22;
        CHECK(((unsigned char *)blk)[1000] == 0x22);
        CHECK(ump_vmm_view_destroy(pool, v) == UMP_OK);
        CHECK(ump_vmm_free(pool, blk) == UMP_OK);

        uintptr_t va;
        uint64_t size;
        int r = -1;
        CHECK(ump_vmm_ring_create(pool, g, &r) == UMP_OK);
        CHECK(ump_vmm_view_info(pool, r, &va, &size, NULL, NULL) == UMP_OK && size == 2 * g);
        ((unsigned char *)va)[g + 7] = 0x33;
        CHECK(((unsigned char *)va)[7] == 0x33);

        int sh = -1, fd = -1, im = -1;
        CHECK(ump_vmm_shared_create(pool, g - 1, &sh) == UMP_OK); /* one granule */
        CHECK(ump_vmm_export(pool, sh, &fd) == UMP_OK && fd >= 0);
        CHECK(ump_vmm_import(pool, fd, 2 * g, 0, &im) == UMP_ERR_HANDLE); /* not the size it has */
        CHECK(im == -1);
        CHECK(ump_vmm_import(pool, fd, g, 0, &im) == UMP_OK);
        close(fd);
        CHECK(ump_vmm_view_info(pool, im, &va, &size, NULL, NULL) == UMP_OK);
        uintptr_t sva;
        CHECK(ump_vmm_view_info(pool, sh, &sva, &size, NULL, NULL) == UMP_OK);
        ((unsigned char *)sva)[g - 1] = 0x44;
        CHECK(((unsigned char *)va)[g - 1] == 0x44);
        CHECK(ump_vmm_view_destroy(pool, sh) == UMP_OK); /* the importer keeps the memory */
        CHECK(((unsigned char *)va)[g - 1] == 0x44);
        CHECK(ump_vmm_view_destroy(pool, im) == UMP_OK);
        CHECK(ump_vmm_view_destroy(pool, r) == UMP_OK);
        CHECK(ump_vmm_view_destroy(pool, r) != UMP_OK);
    }
    return NULL;
}

static void pool_stress(void)
{
    CHECK(ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, (uint64_t)16 << 30, (uint64_t)2 << 30, &pool) ==
          UMP_OK);
    pthread_t t[THREADS], views;
    for (long i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, pool_worker, (void *)i) == 0);
    CHECK(pthread_create(&views, NULL, view_worker, NULL) == 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    pthread_join(views, NULL);
    ump_vmm_stats_t st;
    CHECK(ump_vmm_stats(pool, &st) == UMP_OK);
    CHECK(st.used_bytes == 0 && st.current_count == 0 && st.bad_frees == 0);
    CHECK(st.views == 0 && st.view_bytes == 0 && st.shared_bytes == 0 && st.imported_bytes == 0);
    printf("pool: %llu blocks, peak used %llu, peak physical %llu bytes\n",
           (unsigned long long)st.total_count, (unsigned long long)st.peak_used_bytes,
           (unsigned long long)st.peak_physical_bytes);

    /* Bad frees are refused and counted. */
    uintptr_t a = ump_vmm_alloc(pool, 10000, 1);
    CHECK(ump_vmm_free(pool, a + 512) != UMP_OK);
    CHECK(ump_vmm_free(pool, a) == UMP_OK);
    CHECK(ump_vmm_free(pool, a) != UMP_OK);
    CHECK(ump_vmm_alloc(pool, (uint64_t)1 << 40, 1) == 0);

    /* A mapping that fails half-way is undone. */
    CHECK(ump_vmm_trim(pool, 0) == UMP_OK);
    CHECK(ump_vmm_stats(pool, &st) == UMP_OK && st.physical_bytes == 0);
    uint64_t rollbacks = st.rollbacks; /* the view worker's refused imports */
    ump_fault_inject(1, 1); /* the handle is created, its mapping fails */
    CHECK(ump_vmm_alloc(pool, 8 << 20, 1) == 0 && ump_last_status() == UMP_ERR_INJECTED);
    ump_fault_inject(0, 0);
    CHECK(ump_vmm_stats(pool, &st) == UMP_OK);
    CHECK(st.physical_bytes == 0 && st.mapped_bytes == 0 && st.rollbacks == rollbacks + 1);

    /* Buffers grow in place; migration keeps the address and the data. */
    int buf = -1;
    CHECK(ump_vmm_buffer_create(pool, 64 << 20, &buf) == UMP_OK);
    CHECK(buf >= 0);
    uintptr_t bva;
    uint64_t bsize;
    CHECK(ump_vmm_buffer_info(pool, buf, &bva, &bsize) == UMP_OK && bsize == 0);
    unsigned char *bp = (unsigned char *)bva;
    CHECK(ump_vmm_buffer_resize(pool, buf, 3 << 20) == UMP_OK);
    memset(bp, 0x5a, 3 << 20);
    CHECK(ump_vmm_buffer_resize(pool, buf, 40 << 20) == UMP_OK);
    CHECK(bp[(3 << 20) - 1] == 0x5a);
    memset(bp + (39 << 20), 0x6b, 1 << 20);
    CHECK(ump_vmm_buffer_resize(pool, buf, 65 << 20) != UMP_OK);
    CHECK(ump_vmm_grant(pool, 1) == UMP_OK);
    CHECK(ump_vmm_migrate(pool, (uintptr_t)bp, 40 << 20, 1) == UMP_OK);
    int dev = -1;
    CHECK(ump_vmm_device_of(pool, (uintptr_t)bp, 40 << 20, &dev) == UMP_OK && dev == 1);
    CHECK(bp[0] == 0x5a && bp[(40 << 20) - 1] == 0x6b);
    CHECK(ump_vmm_buffer_resize(pool, buf, 1 << 20) == UMP_OK);

    /* A run of more cached pieces than the undo log's first allocation. */
    uintptr_t one[70];
    for (int i = 0; i < 70; i++)
        CHECK((one[i] = ump_vmm_alloc(pool, 2 << 20, 3)) != 0);
    for (int i = 0; i < 70; i++)
        CHECK(ump_vmm_free(pool, one[i]) == UMP_OK);
    CHECK(ump_vmm_trim(pool, 1) == UMP_OK);
    uintptr_t many = ump_vmm_alloc(pool, (uint64_t)140 << 20, 3);
    CHECK(many != 0);
    memset((void *)many, 0x3c, (size_t)140 << 20);
    CHECK(ump_vmm_free(pool, many) == UMP_OK);
    CHECK(ump_vmm_buffer_destroy(pool, buf) == UMP_OK);
    CHECK(ump_vmm_trim(pool, 0) == UMP_OK);
    CHECK(ump_vmm_stats(pool, &st) == UMP_OK && st.physical_bytes == 0);
    CHECK(ump_vmm_destroy(pool) == UMP_OK);
    CHECK(ump_vmm_stats(pool, &st) != UMP_OK);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        ops_per_thread = atol(argv[1]);
    CHECK(ump_arena_create(UMP_KIND_HOST, UMP_PROVIDER_HOST, (uint64_t)1 << 30, 0, -1, 0, &arena) ==
          UMP_OK);
    CHECK(arena >= 0);
    CHECK(ump_set_numpy_arena(arena) == UMP_OK);

    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, worker, (void *)i) == 0);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);

    ump_stats_t st, fb;
    CHECK(ump_arena_stats(arena, &st) == UMP_OK && ump_fallback_stats(&fb) == UMP_OK);
    CHECK(st.current_bytes == 0 && st.current_count == 0);
    CHECK(fb.current_bytes == 0 && fb.current_count == 0);
    printf("stress: %ld ops, peak %llu bytes in %llu blocks, %llu fallback blocks in total\n",
           ops_per_thread * THREADS, (unsigned long long)st.peak_bytes,
           (unsigned long long)st.peak_count, (unsigned long long)fb.total_count);

    /* Edge cases. */
    CHECK(ump_calloc(SIZE_MAX / 2, 4) == NULL);
    CHECK(ump_malloc(SIZE_MAX) == NULL);
    ump_free(NULL, 0);
    char *foreign = malloc(100);
    uint64_t before = ump_foreign_frees();
    ump_free(foreign, 100); /* not ours: left alone */
    CHECK(ump_foreign_frees() == before + 1);
    CHECK(ump_realloc(foreign, 200) == NULL);
    free(foreign);
    void *p = ump_malloc(1000);
    ump_free(p, 1000);
    ump_free(p, 1000); /* double free: refused */
    CHECK(ump_foreign_frees() == before + 2);
    char *whole = ump_malloc(5000);
    CHECK(ump_arena_free(whole + 512) != UMP_OK); /* interior pointer: refused */
    CHECK(ump_arena_free(whole) == UMP_OK);
    concurrent_bad_frees();

    /* Cap: the NumPy path falls back, the arena path fails. */
    CHECK(ump_arena_trim(arena) == UMP_OK);
    CHECK(ump_arena_stats(arena, &st) == UMP_OK);
    CHECK(ump_arena_set_cap(arena, st.held_bytes + ((uint64_t)4 << 20)) == UMP_OK);
    void *in = ump_malloc(3 << 20);
    uintptr_t base;
    CHECK(ump_lookup((uintptr_t)in, &base, NULL, NULL) == UMP_KIND_HOST);
    void *out = ump_malloc(3 << 20);
    CHECK(out && ump_lookup((uintptr_t)out, NULL, NULL, NULL) == UMP_KIND_NONE);
    CHECK(ump_arena_alloc(arena, 3 << 20) == NULL && ump_last_status() == UMP_ERR_CAP);
    ump_free(in, 0);
    ump_free(out, 0);

    /* Injected provider failures. */
    CHECK(ump_arena_set_cap(arena, (uint64_t)256 << 20) == UMP_OK);
    CHECK(ump_arena_trim(arena) == UMP_OK);
    ump_fault_inject(0, -1);
    CHECK(ump_arena_alloc(arena, 5 << 20) == NULL && ump_last_status() == UMP_ERR_INJECTED);
    void *fallback = ump_malloc(5 << 20);
    CHECK(fallback && ump_lookup((uintptr_t)fallback, NULL, NULL, NULL) == UMP_KIND_NONE);
    ump_free(fallback, 0);
    ump_fault_inject(0, 0);
    void *ok = ump_arena_alloc(arena, 5 << 20);
    CHECK(ok && ump_arena_free(ok) == UMP_OK);

    CHECK(ump_arena_trim(arena) == UMP_OK);
    CHECK(ump_arena_stats(arena, &st) == UMP_OK);
    CHECK(st.held_bytes == 0 && st.cached_bytes == 0);
    CHECK(ump_set_numpy_arena(-1) == UMP_OK);
    pool_stress();
    printf("OK\n");
    return 0;
}
