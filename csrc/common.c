/*
 * common.c - what every unit of the C core shares: the last status and the
 * names of ump's own statuses, fault injection, and fork.
 *
 * It calls no other unit: arena.c, cuda.c and vmm.c build on it.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <pthread.h>
#include <unistd.h>

/* --- status -------------------------------------------------------------- */

static __thread int last_status;

int ump__set_status(int status) { last_status = status; return status; }
int ump_last_status(void) { return last_status; }
int ump_abi_version(void) { return UMP_ABI_VERSION; }

const char *ump__status_name(int status)
{
    switch (status) {
    case UMP_ERR_NOMEM: return "UMP_ERR_NOMEM";
    case UMP_ERR_CAP: return "UMP_ERR_CAP";
    case UMP_ERR_NOCUDA: return "UMP_ERR_NOCUDA";
    case UMP_ERR_FORKED: return "UMP_ERR_FORKED";
    case UMP_ERR_ARG: return "UMP_ERR_ARG";
    case UMP_ERR_INJECTED: return "UMP_ERR_INJECTED";
    default: return NULL;
    }
}

/* --- fault injection ----------------------------------------------------- */

static int64_t inject_after, inject_count;

void ump_fault_inject(int64_t after, int64_t count)
{
    __atomic_store_n(&inject_after, after, __ATOMIC_SEQ_CST);
    __atomic_store_n(&inject_count, count, __ATOMIC_SEQ_CST);
}

int ump__injected_failure(void)
{
    if (__atomic_load_n(&inject_count, __ATOMIC_SEQ_CST) == 0)
        return 0;
    if (__atomic_fetch_sub(&inject_after, 1, __ATOMIC_SEQ_CST) > 0)
        return 0;
    __atomic_store_n(&inject_after, 0, __ATOMIC_SEQ_CST);
    int64_t left = __atomic_load_n(&inject_count, __ATOMIC_SEQ_CST);
    if (left > 0)
        __atomic_fetch_sub(&inject_count, 1, __ATOMIC_SEQ_CST);
    return 1;
}

/* --- fork ---------------------------------------------------------------- */

volatile int ump__forked;

int ump_is_forked_child(void) { return ump__forked; }
