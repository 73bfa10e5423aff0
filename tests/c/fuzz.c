/*
 * fuzz.c - random calls into the C core with hostile arguments, for the
 * sanitizer builds: sizes from 0 to UINT64_MAX, pointers that are interior,
 * freed, foreign or no address at all, ids that name nothing, descriptors
 * that are closed, foreign or lie about their size, injected driver
 * failures (ump_fault_status). Every call must answer with a status, never
 * touch memory that is not its own (ASan) or misbehave arithmetically
 * (UBSan); the bookkeeping is checked against a model after every step and
 * the data of every live block against the pattern written into it.
 *
 * usage: fuzz OPS [SEED]. The seed is printed first: a failure is rerun with
 * it (tests/test_sanitizers.py prints the output of a failing run).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../../csrc/ump.h"
#include "check.h"

#define MiB ((uint64_t)1 << 20)
#define GRAN (2 * MiB)
#define CUDA_ERROR_OUT_OF_MEMORY 2 /* cuda.h: what a driver out of memory answers */
enum { NBLK = 48, NVIEW = 8, NHOOK = 48 };

static uint64_t seed_state;

static uint64_t rnd(void)
{
    uint64_t z = (seed_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }

/* Sizes as a peer or a careless caller gives them. */
static uint64_t hostile_size(void)
{
    switch (below(12)) {
    case 0: return 0;
    case 1: return UINT64_MAX - below(4096);
    case 2: return (uint64_t)1 << (40 + below(24));
    case 3: return UMP_VMM_MAX_BYTES + below(3) - 1;
    case 4: return GRAN * (1 + below(8)) + below(3) - 1;
    case 5: case 6: return 1 + below(64 * 1024);
    default: return 1 + below(6 * MiB);
    }
}

typedef struct { uintptr_t p; uint64_t n; uintptr_t stream; unsigned char tag; } blk_t;
typedef struct { int id, kind; uintptr_t va; uint64_t size; unsigned char tag; } view_t;
typedef struct { unsigned char *p; size_t n; unsigned char tag; } hook_t;

static int pool;
static blk_t blk[NBLK];
static view_t view[NVIEW];
static hook_t hook[NHOOK];
static uint64_t used_model;
static long counts[32];

/* A status a call may fail with: ump's, or the driver's injected one. */
static int failure(int s)
{
    return s == UMP_ERR_NOMEM || s == UMP_ERR_CAP || s == UMP_ERR_ARG || s == UMP_ERR_INJECTED ||
           s == UMP_ERR_HANDLE || s == UMP_ERR_OS || s == UMP_ERR_RANGE || s == CUDA_ERROR_OUT_OF_MEMORY;
}

static void stamp(uintptr_t p, uint64_t n, unsigned char tag)
{
    if (!n)
        return;
    ((unsigned char *)p)[0] = tag;
    ((unsigned char *)p)[n / 2] = tag;
    ((unsigned char *)p)[n - 1] = tag;
}

static void seen(uintptr_t p, uint64_t n, unsigned char tag)
{
    if (!n)
        return;
    CHECK(((unsigned char *)p)[0] == tag && ((unsigned char *)p)[n / 2] == tag &&
          ((unsigned char *)p)[n - 1] == tag);
}

/* A pointer nobody should trust: interior, past a block, wrapped, garbage. */
static uintptr_t hostile_ptr(void)
{
    blk_t *b = &blk[below(NBLK)];
    switch (below(6)) {
    case 0: return b->p ? b->p + 512 * (1 + below(4)) : 4096;
    case 1: return b->p ? b->p + (uintptr_t)(UINT64_MAX - below(4096)) : 0;
    case 2: return (uintptr_t)rnd();
    case 3: return (uintptr_t)&blk; /* ours, but no block */
    case 4: return 0;
    default: return b->p ? b->p - 512 : 1;
    }
}

static void check_pool(void)
{
    ump_vmm_stats_t st;
    CHECK(ump_vmm_stats(pool, &st) == UMP_OK);
    CHECK(st.used_bytes == used_model);
    int live = 0, views = 0;
    for (int i = 0; i < NBLK; i++)
        if (blk[i].p) {
            live++;
            uintptr_t base;
            uint64_t size;
            CHECK(ump_lookup(blk[i].p + (blk[i].n ? blk[i].n - 1 : 0), &base, &size, NULL) == UMP_KIND_HOST);
            CHECK(base == blk[i].p && size >= blk[i].n);
        }
    for (int i = 0; i < NVIEW; i++)
        views += view[i].id >= 0;
    CHECK(st.current_count == (uint64_t)live && st.views == (uint64_t)views);
    CHECK(st.stream_bins <= 64);
}

/* --- the pool ------------------------------------------------------------- */

static void op_alloc(void)
{
    blk_t *b = &blk[below(NBLK)];
    if (b->p)
        return;
    uint64_t n = below(4) ? below(3 * MiB) : hostile_size();
    /* A handful of streams, now and then a new one (the bins' bound). */
    uintptr_t stream = below(8) ? below(4) : 1000 + rnd() % 100000;
    uintptr_t p = ump_vmm_alloc(pool, n, stream);
    if (!p) {
        int s = ump_last_status();
        CHECK(failure(s) && s != UMP_ERR_ARG && s != UMP_ERR_HANDLE);
        counts[0]++;
        return;
    }
    CHECK(p % UMP_ALIGN == 0 && n <= ((uint64_t)1 << 32));
    *b = (blk_t){p, n, stream, (unsigned char)(1 + below(250))};
    stamp(p, n, b->tag);
    used_model += n ? (n + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN;
    counts[1]++;
}

static void op_free(void)
{
    blk_t *b = &blk[below(NBLK)];
    if (!b->p || below(4) == 0) {
        ump_vmm_stats_t st;
        CHECK(ump_vmm_stats(pool, &st) == UMP_OK);
        uintptr_t bad = hostile_ptr();
        int s = ump_vmm_free(pool, bad);
        int ours = 0;
        for (int i = 0; i < NBLK; i++)
            ours |= blk[i].p && blk[i].p == bad;
        if (ours) { /* it happened to name a live block: it is freed */
            CHECK(s == UMP_OK);
            for (int i = 0; i < NBLK; i++)
                if (blk[i].p == bad) {
                    used_model -= blk[i].n ? (blk[i].n + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN;
                    blk[i].p = 0;
                }
        } else {
            CHECK(s == UMP_ERR_ARG);
        }
        counts[2]++;
        return;
    }
    seen(b->p, b->n, b->tag);
    CHECK(ump_vmm_free(pool, b->p) == UMP_OK);
    CHECK(ump_vmm_free(pool, b->p) == UMP_ERR_ARG); /* a double free is refused */
    used_model -= b->n ? (b->n + UMP_ALIGN - 1) / UMP_ALIGN * UMP_ALIGN : UMP_ALIGN;
    b->p = 0;
    counts[3]++;
}

static void op_pool_misc(void)
{
    int dev;
    blk_t *b = &blk[below(NBLK)];
    switch (below(7)) {
    case 0:
        CHECK(ump_vmm_trim(pool, (int)below(2)) == UMP_OK);
        break;
    case 1: { /* a limit, often below what is held; always one, or a view of
               * 2**46 bytes would be made (sparse memfds map): slow, not wrong */
        uint64_t limit = (1 + below(128)) * GRAN;
        CHECK(ump_vmm_set_limit(pool, limit) == UMP_OK);
        break;
    }
    case 2:
        if (b->p && b->n) {
            CHECK(ump_vmm_device_of(pool, b->p, b->n, &dev) == UMP_OK && dev >= -1);
        } else {
            int s = ump_vmm_device_of(pool, hostile_ptr(), hostile_size(), &dev);
            CHECK(s == UMP_OK || s == UMP_ERR_ARG);
        }
        break;
    case 3: { /* a device index from nowhere */
        int d = (int)(below(3) ? below(3) : rnd());
        int s = ump_vmm_grant(pool, d);
        CHECK(s == UMP_OK || s == UMP_ERR_ARG);
        break;
    }
    case 4:
        if (b->p && b->n) {
            int s = ump_vmm_migrate(pool, b->p, below(2) ? b->n : hostile_size(), (int)below(3));
            CHECK(s == UMP_OK || failure(s));
            if (s == UMP_OK)
                seen(b->p, b->n, b->tag);
        }
        break;
    case 5: { /* buffers: hostile sizes, ids that name nothing */
        int buf = -1;
        uint64_t max = below(2) ? 1 + below(16 * MiB) : hostile_size();
        int s = ump_vmm_buffer_create(pool, max, &buf);
        if (s != UMP_OK) {
            CHECK(failure(s) && buf == -1);
            break;
        }
        uint64_t to = below(2) ? below(max + 1) : hostile_size();
        s = ump_vmm_buffer_resize(pool, buf, to);
        CHECK(s == UMP_OK || failure(s));
        uintptr_t va;
        uint64_t size;
        CHECK(ump_vmm_buffer_info(pool, buf, &va, &size) == UMP_OK);
        if (size)
            stamp(va, size, 7), seen(va, size, 7);
        CHECK(ump_vmm_buffer_destroy(pool, buf) == UMP_OK);
        CHECK(ump_vmm_buffer_destroy(pool, buf) == UMP_ERR_ARG);
        break;
    }
    default: { /* ids no buffer or view has */
        uintptr_t va;
        uint64_t size;
        int id = (int)rnd();
        CHECK(ump_vmm_buffer_info(pool, id | 0x4000, &va, &size) == UMP_ERR_ARG);
        CHECK(ump_vmm_view_destroy(pool, id | 0x4000) == UMP_ERR_ARG);
        CHECK(ump_vmm_stats(id | 0x40000000, NULL) == UMP_ERR_ARG);
        break;
    }
    }
    counts[4]++;
}

/* --- views, and imports of what a peer might send ------------------------- */

static int view_slot(void)
{
    for (int i = 0; i < NVIEW; i++)
        if (view[i].id < 0)
            return i;
    return -1;
}

static void remember(int slot, int id, int kind)
{
    uintptr_t va;
    uint64_t size;
    CHECK(ump_vmm_view_info(pool, id, &va, &size, NULL, NULL) == UMP_OK && size > 0);
    view[slot] = (view_t){id, kind, va, size, (unsigned char)(1 + below(250))};
    stamp(va, size, view[slot].tag);
}

/* A descriptor a hostile peer could send in place of the memory it names. */
static int hostile_fd(int good, uint64_t *claim)
{
    switch (below(6)) {
    case 0: return open("/dev/null", O_RDWR | O_CLOEXEC);
    case 1: { /* the right name, no seals: shrinkable under the importer */
        int fd = memfd_create("ump-vmm-shared", MFD_CLOEXEC);
        CHECK(fd >= 0 && ftruncate(fd, (off_t)*claim) == 0);
        return fd;
    }
    case 2: { /* closed */
        int fd = dup(good);
        close(fd);
        return fd;
    }
    case 3: /* the real memory, a lying size */
        *claim = below(2) ? *claim * 2 : hostile_size();
        return fcntl(good, F_DUPFD_CLOEXEC, 0);
    case 4: { /* a pipe */
        int p[2];
        CHECK(pipe2(p, O_CLOEXEC) == 0);
        close(p[1]);
        return p[0];
    }
    default:
        return fcntl(good, F_DUPFD_CLOEXEC, 0);
    }
}

/* Close one view, if the slot picked holds one; a second close is refused. */
static void view_close_one(void)
{
    view_t *v = &view[below(NVIEW)];
    if (v->id >= 0) {
        seen(v->va, v->size, v->tag);
        CHECK(ump_vmm_view_destroy(pool, v->id) == UMP_OK);
        CHECK(ump_vmm_view_destroy(pool, v->id) == UMP_ERR_ARG);
        v->id = -1;
    }
}

static void op_view(void)
{
    int slot = view_slot(), id = -1, s;
    if (slot < 0 || below(3) == 0) {
        view_close_one();
        return;
    }
    uint64_t n = below(2) ? GRAN * (1 + below(3)) : hostile_size();
    switch (below(5)) {
    case 0:
        s = ump_vmm_ring_create(pool, n, &id);
        break;
    case 1:
        s = ump_vmm_shared_create(pool, n, &id);
        break;
    case 2: {
        int devs[3] = {0, 1, (int)below(3)};
        s = ump_vmm_striped_create(pool, n, devs, 1 + (int)below(3), &id);
        break;
    }
    case 3: { /* an alias of part of a live block, or of nothing */
        blk_t *b = &blk[below(NBLK)];
        uintptr_t alias = 0, at = b->p && below(2) ? b->p + below(b->n + 1) : hostile_ptr();
        s = ump_vmm_alias_create(pool, at, below(2) && b->p ? 1 + below(b->n + 1) : hostile_size(), &alias,
                                 &id);
        if (s == UMP_OK) { /* the alias reaches no further than the view */
            uintptr_t va;
            uint64_t size;
            CHECK(ump_vmm_view_info(pool, id, &va, &size, NULL, NULL) == UMP_OK);
            CHECK(alias >= va && alias < va + size);
            CHECK(ump_vmm_view_destroy(pool, id) == UMP_OK); /* the block may be freed next */
            counts[5]++;
            return;
        }
        break;
    }
    default: { /* export a shared view, import what a peer may send for it */
        int sh = -1, fd = -1;
        if (ump_vmm_shared_create(pool, GRAN * (1 + below(2)), &sh) != UMP_OK)
            return;
        CHECK(ump_vmm_export(pool, sh + 100, &fd) == UMP_ERR_ARG && fd == -1);
        s = ump_vmm_export(pool, sh, &fd);
        if (s != UMP_OK) { /* an injected failure */
            CHECK(failure(s) && fd == -1 && ump_vmm_view_destroy(pool, sh) == UMP_OK);
            return;
        }
        uintptr_t va;
        uint64_t size, claim;
        CHECK(ump_vmm_view_info(pool, sh, &va, &size, NULL, NULL) == UMP_OK);
        claim = size;
        int peer = hostile_fd(fd, &claim);
        s = ump_vmm_import(pool, peer, claim, (int)below(2), &id);
        if (peer >= 0)
            close(peer);
        close(fd);
        if (s == UMP_OK) {
            CHECK(claim == size);
            CHECK(ump_vmm_view_info(pool, id, &va, &size, NULL, NULL) == UMP_OK && size == claim);
        } else {
            CHECK((s == UMP_ERR_HANDLE || s == UMP_ERR_ARG || s == UMP_ERR_INJECTED || s == UMP_ERR_OS ||
                   s == CUDA_ERROR_OUT_OF_MEMORY) && id == -1);
        }
        CHECK(ump_vmm_view_destroy(pool, sh) == UMP_OK); /* the importer keeps the memory */
        counts[6]++;
        break;
    }
    }
    if (s == UMP_OK) {
        remember(slot, id, 0);
        counts[7]++;
    } else {
        CHECK(failure(s) && id == -1); /* no id is written for a failure */
        counts[8]++;
    }
}

/* --- the NumPy hooks -------------------------------------------------------- */

static void op_hooks(int arena)
{
    hook_t *h = &hook[below(NHOOK)];
    switch (below(7)) {
    case 0: case 1: {
        if (h->p)
            return;
        size_t n = below(3) ? below(300000) : (size_t)hostile_size(), nmemb = 1, each = n;
        if (below(4) == 0) /* n elements of 3 bytes: past SIZE_MAX, refused */
            nmemb = n, each = 3;
        unsigned char *p = below(2) ? ump_malloc(n) : ump_calloc(nmemb, each);
        if (!p) {
            counts[9]++;
            return;
        }
        CHECK((uintptr_t)p % UMP_ALIGN == 0);
        *h = (hook_t){p, n, (unsigned char)(1 + below(250))};
        stamp((uintptr_t)p, n, h->tag);
        break;
    }
    case 2:
        if (h->p) {
            seen((uintptr_t)h->p, h->n, h->tag);
            size_t n = below(4) ? below(400000) : (size_t)hostile_size();
            unsigned char *q = ump_realloc(h->p, n);
            if (q) {
                size_t keep = n < h->n ? n : h->n;
                if (keep)
                    CHECK(q[0] == h->tag);
                h->p = q;
                h->n = n;
                stamp((uintptr_t)q, n, h->tag);
            }
        }
        break;
    case 3:
        if (h->p) {
            seen((uintptr_t)h->p, h->n, h->tag);
            ump_free(h->p, h->n);
            uint64_t before = ump_foreign_frees();
            ump_free(h->p, h->n); /* double free: counted, ignored */
            CHECK(ump_foreign_frees() == before + 1);
            h->p = NULL;
        }
        break;
    case 4: { /* pointers that are not ours */
        uint64_t before = ump_foreign_frees();
        void *bad = (void *)hostile_ptr();
        if (bad) {
            int live = 0;
            for (int i = 0; i < NHOOK; i++)
                live |= hook[i].p == bad;
            if (!live) {
                ump_free(bad, 64);
                CHECK(ump_foreign_frees() == before + 1);
                CHECK(ump_realloc(bad, 64) == NULL);
            }
        }
        break;
    }
    case 5: /* the cap moves: the hooks fall back to plain (and mapped) memory */
        CHECK(ump_arena_set_cap(arena, below(2) ? below(64) * MiB : (uint64_t)1 << 30) == UMP_OK);
        break;
    default:
        CHECK(ump_arena_trim(arena) == UMP_OK);
        break;
    }
    counts[10]++;
}

int main(int argc, char **argv)
{
    long ops = argc > 1 ? atol(argv[1]) : 20000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)getpid();
    printf("fuzz seed: %llu (rerun: fuzz %ld %llu)\n", (unsigned long long)seed, ops,
           (unsigned long long)seed);
    fflush(stdout);
    seed_state = seed;
    int arena;
    CHECK(ump_arena_create(UMP_KIND_HOST, UMP_PROVIDER_HOST, (uint64_t)1 << 30, 0, 21, 0, &arena) == UMP_OK);
    CHECK(ump_set_numpy_arena(arena) == UMP_OK);
    CHECK(ump_vmm_create(UMP_PROVIDER_HOST, 0, 0, (uint64_t)1 << 30, 256 * MiB, &pool) == UMP_OK);
    for (int i = 0; i < NVIEW; i++)
        view[i].id = -1;
    for (long op = 0; op < ops; op++) {
        /* Now and then the next provider or driver call fails, as a
         * driver out of memory (a CUresult) or ump's injected failure. */
        if (below(50) == 0) {
            ump_fault_status(below(2) ? CUDA_ERROR_OUT_OF_MEMORY : 0);
            ump_fault_inject((int64_t)below(4), 1);
        }
        switch (below(10)) {
        case 0: case 1: case 2: op_alloc(); break;
        case 3: case 4: op_free(); break;
        case 5: op_pool_misc(); break;
        case 6: case 7: op_view(); break;
        default: op_hooks(arena); break;
        }
        ump_fault_inject(0, 0);
        check_pool();
    }
    for (int i = 0; i < NBLK; i++)
        if (blk[i].p) {
            seen(blk[i].p, blk[i].n, blk[i].tag);
            CHECK(ump_vmm_free(pool, blk[i].p) == UMP_OK);
        }
    for (int i = 0; i < NVIEW; i++)
        if (view[i].id >= 0)
            CHECK(ump_vmm_view_destroy(pool, view[i].id) == UMP_OK);
    for (int i = 0; i < NHOOK; i++)
        ump_free(hook[i].p, hook[i].n);
    ump_vmm_stats_t st;
    CHECK(ump_vmm_trim(pool, 0) == UMP_OK && ump_vmm_stats(pool, &st) == UMP_OK);
    CHECK(st.used_bytes == 0 && st.views == 0 && st.physical_bytes == 0 && st.imported_bytes == 0);
    CHECK(ump_vmm_destroy(pool) == UMP_OK);
    CHECK(ump_set_numpy_arena(-1) == UMP_OK && ump_arena_trim(arena) == UMP_OK);
    ump_stats_t as, fb;
    CHECK(ump_arena_stats(arena, &as) == UMP_OK && as.current_count == 0 && as.held_bytes == 0);
    CHECK(ump_fallback_stats(&fb) == UMP_OK && fb.current_count == 0);
    printf("fuzz: %ld ops (blocks %ld, refused %ld; frees %ld, bad %ld; pool calls %ld; views %ld, "
           "refused %ld, imports %ld, aliases %ld; hooks %ld)\nOK\n",
           ops, counts[1], counts[0], counts[3], counts[2], counts[4], counts[7], counts[8], counts[6],
           counts[5], counts[10]);
    return 0;
}
