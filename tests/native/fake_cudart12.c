/*
 * A stand-in libcudart.so.12 for tests/test_bridge.py: what edgeq's CUDA 12 bridge forwards to.
 *
 * Compiled against the CUDA 12.6 headers and the bridge's generated edgeq_cudart_bridge.h, with SONAME
 * libcudart.so.12 (fake_cudart12_rest.c adds the other functions the TVM runtime imports).
 * cudaGetDeviceProperties_v2 fills every field of CUDA 12's struct cudaDeviceProp: field k (in the
 * struct's order) gets bytes (7k + j + 1) & 0xff, then a few fields get readable values (FAKE_* below,
 * which the test repeats). The old cudaGetDeviceProperties (12.x's v1 ABI) fails, so a bridge calling it
 * is caught.
 */
#include <stddef.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "edgeq_cudart_bridge.h"

#if CUDART_VERSION / 1000 != 12
#error "compile the fake libcudart.so.12 against the CUDA 12 headers"
#endif

/* The bridge's generated copy of the 12.x struct has the real one's layout. */
_Static_assert(sizeof(struct cudaDeviceProp) == sizeof(struct edgeq_cudaDeviceProp12), "struct size");
#define CHECK_FIELD(f)                                                                                     \
    _Static_assert(offsetof(struct cudaDeviceProp, f) == offsetof(struct edgeq_cudaDeviceProp12, f) &&      \
                       sizeof(((struct cudaDeviceProp *)0)->f) == sizeof(((struct edgeq_cudaDeviceProp12 *)0)->f), \
                   "field " #f);
EDGEQ_PROP12_FIELDS(CHECK_FIELD)

cudaError_t CUDARTAPI cudaGetDeviceProperties_v2(struct cudaDeviceProp *prop, int device) {
    int k = 0;
    if (prop == NULL || device != 0)
        return cudaErrorInvalidValue;
#define FILL(f)                                                                                            \
    for (size_t j = 0; j < sizeof prop->f; j++)                                                            \
        ((unsigned char *)&prop->f)[j] = (unsigned char)(7 * k + j + 1);                                   \
    k++;
    EDGEQ_PROP12_FIELDS(FILL)
    memset(prop->name, 0, sizeof prop->name);
    strcpy(prop->name, "edgeq-fake-gpu");
    prop->totalGlobalMem = 0x123456789;
    prop->major = 8;
    prop->minor = 7;
    prop->multiProcessorCount = 16;
    prop->maxGridSize[0] = 1;
    prop->maxGridSize[1] = 2;
    prop->maxGridSize[2] = 3;
    prop->warpSize = 32;
    prop->l2CacheSize = 4 << 20;
    prop->clockRate = 1300000; /* gone in CUDA 13 */
    prop->unifiedFunctionPointers = 1;
    return cudaSuccess;
}

#undef cudaGetDeviceProperties
cudaError_t CUDARTAPI cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    (void)prop;
    (void)device;
    return cudaErrorNotSupported;
}

cudaError_t CUDARTAPI cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}

const char *CUDARTAPI cudaGetErrorString(cudaError_t error) {
    return error == cudaSuccess ? "fake: no error" : "fake: some error";
}

const char *CUDARTAPI cudaGetErrorName(cudaError_t error) {
    return error == cudaSuccess ? "cudaSuccess" : "cudaErrorFake";
}

cudaError_t CUDARTAPI cudaRuntimeGetVersion(int *version) {
    *version = 12060;
    return cudaSuccess;
}
