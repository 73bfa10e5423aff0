/*
 * cudadrv.h - the part of CUDA's driver API (cuda.h) the C core uses.
 *
 * libcuda.so.1 is opened at run time, so the core builds without the CUDA
 * toolkit; these declarations copy cuda.h's names and values, so that a
 * reader can look each one up there. Not part of ump's public API.
 */
#ifndef UMP_CUDADRV_H
#define UMP_CUDADRV_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef uintptr_t CUdeviceptr;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUmemGenericAllocationHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2

/* cuMemAllocManaged */
#define CU_MEM_ATTACH_GLOBAL 0x1

/* cuMemHostRegister */
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02

/* cuMemAdvise, cuMemPrefetchAsync */
#define CU_DEVICE_CPU (-1)

/* cuMemAdvise's advice, each with the name ump.advise takes for it. */
#define CU_MEM_ADVICES(X)                                                         \
    X(CU_MEM_ADVISE_SET_READ_MOSTLY, 1, "read_mostly")                            \
    X(CU_MEM_ADVISE_UNSET_READ_MOSTLY, 2, "unset_read_mostly")                    \
    X(CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 3, "preferred_location")              \
    X(CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, 4, "unset_preferred_location")      \
    X(CU_MEM_ADVISE_SET_ACCESSED_BY, 5, "accessed_by")                            \
    X(CU_MEM_ADVISE_UNSET_ACCESSED_BY, 6, "unset_accessed_by")

enum {
#define CU_MEM_ADVICE_ENUM(name, value, label) name = (value),
    CU_MEM_ADVICES(CU_MEM_ADVICE_ENUM)
#undef CU_MEM_ADVICE_ENUM
};

/* cuDeviceGetAttribute: the attributes ump reads. */
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY 83
#define CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS 88
#define CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS 89
#define CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM 91
#define CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES 100
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_* */
    int id;
} CUmemLocation;

#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2

/* Virtual memory management: cuMemCreate, cuMemSetAccess, ... */
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_* */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_* */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_* */
} CUmemAccessDesc;

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_NONE 0 /* no shareable handle */
/* An allocation created with this in requestedHandleTypes can be exported
 * (cuMemExportToShareableHandle) as a file descriptor, which another process
 * imports (cuMemImportFromShareableHandle, the fd passed as the void *). */
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1

#endif
