/* check.h - what the programs in tests/c share: CHECK, which ends the
 * program with the failed condition's place, so that a sanitizer build
 * fails the test that runs it. */
#ifndef UMP_TESTS_CHECK_H
#define UMP_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond)                                                           \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#endif
