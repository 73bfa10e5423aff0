/*
 * common.c - what every unit of the C core shares: the last status and the
 * names of ump's own statuses, fault injection, and fork.
 *
 * It calls no other unit: every other unit builds on it.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <unistd.h>

/* --- status -------------------------------------------------------------- */

static __thread int last_status, last_os_error;

int ump__set_status(int status) { last_status = status; return status; }
int ump_last_status(void) { return last_status; }
int ump_last_os_error(void) { return last_os_error; }

int ump__os_status(int err)
{
    /* Only a lack of memory is out-of-memory: running out of descriptors
     * (EMFILE) or a sealed or foreign file is not, and the caller should
     * read which it was. */
    if (err == ENOMEM)
        return UMP_ERR_NOMEM;
    last_os_error = err;
    return UMP_ERR_OS;
}

const char *ump__status_name(int status)
{
    switch (status) {
#define UMP_ERROR_CASE(name, value) case name: return #name;
    UMP_ERRORS(UMP_ERROR_CASE)
#undef UMP_ERROR_CASE
    default: return NULL;
    }
}

/* --- fault injection ----------------------------------------------------- */

static int64_t inject_after, inject_count;
static uint32_t inject_delay_us;
static int inject_signal_fd = -1;
static int inject_status = UMP_ERR_INJECTED;

void ump_fault_status(int status)
{
    __atomic_store_n(&inject_status, status ? status : UMP_ERR_INJECTED, __ATOMIC_RELAXED);
}

void ump_fault_delay(uint32_t usec) { __atomic_store_n(&inject_delay_us, usec, __ATOMIC_RELAXED); }

void ump_fault_signal(int fd) { __atomic_store_n(&inject_signal_fd, fd, __ATOMIC_RELEASE); }

void ump_fault_inject(int64_t after, int64_t count)
{
    __atomic_store_n(&inject_after, after, __ATOMIC_SEQ_CST);
    __atomic_store_n(&inject_count, count, __ATOMIC_SEQ_CST);
    if (count == 0)
        ump_fault_status(0);
}

static int injected(void)
{
    int fd = __atomic_exchange_n(&inject_signal_fd, -1, __ATOMIC_ACQ_REL);
    if (fd >= 0) {
        char reached = 1;
        while (write(fd, &reached, 1) < 0 && errno == EINTR)
            ;
    }
    uint32_t delay = __atomic_load_n(&inject_delay_us, __ATOMIC_RELAXED);
    if (delay)
        usleep(delay);
    if (__atomic_load_n(&inject_count, __ATOMIC_SEQ_CST) == 0)
        return 0;
    if (__atomic_fetch_sub(&inject_after, 1, __ATOMIC_SEQ_CST) > 0)
        return 0;
    __atomic_store_n(&inject_after, 0, __ATOMIC_SEQ_CST);
    /* Compare-exchange: two threads that both read one failure left would
     * both decrement, to -1, which means "fail every call". */
    int64_t left = __atomic_load_n(&inject_count, __ATOMIC_SEQ_CST);
    do {
        if (left == 0)
            return 0; /* another thread took the last one */
        if (left < 0)
            return 1;
    } while (!__atomic_compare_exchange_n(&inject_count, &left, left - 1, 0, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST));
    return 1;
}

int ump__injected_failure(void)
{
    return injected() ? __atomic_load_n(&inject_status, __ATOMIC_RELAXED) : UMP_OK;
}

/* --- fork ----------------------------------------------------------------
 * One set of pthread_atfork handlers for the whole core. Every lock is held
 * across fork(), so the child never inherits one held by a thread that does
 * not exist there (it would hang on it forever). Prepare takes the locks rank
 * by rank, the order internal.h documents; the parent releases them in
 * reverse; the child first marks itself forked, so it never calls CUDA, then
 * each unit re-initialises its locks. */

volatile int ump__forked;

int ump_is_forked_child(void) { return ump__forked; }

static struct {
    void (*prepare)(void), (*parent)(void), (*child)(void);
} fork_hooks[UMP_FORK_RANKS];

void ump__on_fork(enum ump__fork_rank rank, void (*prepare)(void), void (*parent)(void),
                  void (*child)(void))
{
    fork_hooks[rank].prepare = prepare;
    fork_hooks[rank].parent = parent;
    fork_hooks[rank].child = child;
}

static void fork_prepare(void)
{
    for (int r = 0; r < UMP_FORK_RANKS; r++)
        if (fork_hooks[r].prepare)
            fork_hooks[r].prepare();
}

static void fork_parent(void)
{
    for (int r = UMP_FORK_RANKS - 1; r >= 0; r--)
        if (fork_hooks[r].parent)
            fork_hooks[r].parent();
}

static void fork_child(void)
{
    ump__forked = 1;
    for (int r = UMP_FORK_RANKS - 1; r >= 0; r--)
        if (fork_hooks[r].child)
            fork_hooks[r].child();
}

/* The units register from their own constructors, in any order: the table
 * is static, and nothing forks while the library is being loaded. */
__attribute__((constructor)) static void common_init(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}
