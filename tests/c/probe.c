/*
 * probe.c - the devices' C calls (csrc/device.c) on a driver that answers
 * them: tests/c/stub_cuda.c (path in UMP_TEST_LIBCUDA), with two devices.
 * Before the driver is opened every call says UMP_ERR_NOCUDA; after, the
 * probe reads what the stub answers, contexts are retained and released in
 * pairs, free memory is asked under the device's context, and bad arguments
 * are refused. Threads probe and retain at once, under the sanitizers.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/ump.h"
#include "check.h"

static long rounds = 1000;

static void *prober(void *arg)
{
    int device = (int)(intptr_t)arg;
    for (long r = 0; r < rounds; r++) {
        ump_device_t d;
        char name[64];
        uintptr_t ctx = 0;
        uint64_t free_bytes = 0, total = 0;
        int can = -1, active = -1;
        CHECK(ump_device_probe(device, &d, name, sizeof name) == UMP_OK);
        CHECK(d.compute_capability_major == 9 && d.vmm_supported == 1 && d.vmm_granularity == 2u << 20);
        CHECK(d.total_memory == (uint64_t)16 << 30 && d.pageable_memory_access == 0);
        CHECK(ump_device_retain(device, &ctx) == UMP_OK && ctx == 0x1000u + (unsigned)device);
        CHECK(ump_device_memory(ctx, &free_bytes, &total) == UMP_OK && free_bytes < total);
        CHECK(ump_device_active(device, &active) == UMP_OK && active == 1);
        CHECK(ump_device_can_access_peer(device, 1 - device, &can) == UMP_OK && can == 1);
        CHECK(ump_context_push(ctx) == UMP_OK && ump_context_pop() == UMP_OK);
        CHECK(ump_device_release(device) == UMP_OK);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = atol(argv[1]);
    int version = 0, count = 0, active = 0;
    uintptr_t ctx = 0;
    ump_device_t d;
    CHECK(ump_cuda_init(&version, &count) == UMP_ERR_NOCUDA && ump_last_status() == UMP_ERR_NOCUDA);
    CHECK(ump_device_probe(0, &d, NULL, 0) == UMP_ERR_NOCUDA);
    CHECK(ump_device_retain(0, &ctx) == UMP_ERR_NOCUDA && ctx == 0);
    CHECK(ump_context_pop() == UMP_ERR_NOCUDA);
    CHECK(ump_cuda_load("/nonexistent/libcuda.so.1") == UMP_ERR_NOCUDA);

    const char *lib = getenv("UMP_TEST_LIBCUDA");
    CHECK(lib && setenv("STUB_CUDA_DEVICES", "2", 1) == 0 && ump_cuda_load(lib) == UMP_OK);
    CHECK(ump_cuda_init(&version, &count) == UMP_OK && version == 13000 && count == 2);
    char name[8]; /* shorter than the name: cut, and ended */
    CHECK(ump_device_probe(1, &d, name, sizeof name) == UMP_OK && strlen(name) == sizeof name - 1);
    CHECK(ump_device_probe(2, &d, NULL, 0) != UMP_OK); /* no such device */
    CHECK(ump_device_probe(-1, &d, NULL, 0) == UMP_ERR_ARG);
    CHECK(ump_device_probe(0, NULL, NULL, 0) == UMP_ERR_ARG);
    CHECK(ump_device_probe(0, &d, NULL, 8) == UMP_ERR_ARG);
    CHECK(ump_device_memory(0, NULL, NULL) == UMP_ERR_ARG);
    CHECK(ump_device_active(0, &active) == UMP_OK && active == 0);

    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        CHECK(pthread_create(&t[i], NULL, prober, (void *)(intptr_t)(i % 2)) == 0);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    CHECK(ump_device_active(0, &active) == UMP_OK && active == 0); /* every retain released */
    printf("probe: %ld rounds x 4 threads\nOK\n", rounds);
    return 0;
}
