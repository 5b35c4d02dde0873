/*
 * Calls edgeq's CUDA 12 bridge the way the TVM runtime does and prints what it got as JSON, for
 * tests/test_bridge.py. Compiled against the CUDA 13 headers and the bridge's generated header, linked
 * against the bridge (libcudart.so.13).
 *
 * cudaGetDeviceProperties writes into a buffer that is the CUDA 13 struct, filled with 0xCD, followed by
 * 64 canary bytes of 0xAB; "fields" has each field CUDA 12 and 13 share as [offset, hex bytes] and
 * "struct" the whole struct as hex.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "edgeq_cudart_bridge.h"

const char *edgeq_cudart_bridge_error(void);
const char *edgeq_cudart_bridge_target(void);

#define CANARY 64

static void json_string(const char *key, const char *s) {
    printf("\"%s\": ", key);
    if (s == NULL) {
        printf("null, ");
        return;
    }
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    printf("\", ");
}

static void hex(const void *p, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++)
        printf("%02x", ((const unsigned char *)p)[i]);
    putchar('"');
}

int main(void) {
    static union {
        struct cudaDeviceProp prop;
        unsigned char bytes[sizeof(struct cudaDeviceProp) + CANARY];
    } buf;
    struct cudaDeviceProp *prop = &buf.prop;
    int count = -1, canary_ok = 1, first = 1;
    cudaError_t count_rc, rc;
    Dl_info info = {0};
    void *fn;

    memset(buf.bytes, 0xCD, sizeof(struct cudaDeviceProp));
    memset(buf.bytes + sizeof(struct cudaDeviceProp), 0xAB, CANARY);
    count_rc = cudaGetDeviceCount(&count);
    rc = cudaGetDeviceProperties(prop, 0);
    for (size_t i = 0; i < CANARY; i++)
        canary_ok &= buf.bytes[sizeof(struct cudaDeviceProp) + i] == 0xAB;
    fn = dlsym(RTLD_DEFAULT, "cudaGetDeviceProperties");
    if (fn)
        dladdr(fn, &info);

    printf("{\"count_rc\": %d, \"count\": %d, \"rc\": %d, ", (int)count_rc, count, (int)rc);
    json_string("error_string", cudaGetErrorString(rc));
    json_string("error_name", cudaGetErrorName(rc));
    json_string("bridge_error", edgeq_cudart_bridge_error());
    json_string("target", edgeq_cudart_bridge_target());
    json_string("provider", info.dli_fname);
    printf("\"canary_ok\": %s, \"sizeof\": %zu, ", canary_ok ? "true" : "false", sizeof(struct cudaDeviceProp));
    json_string("name", rc == cudaSuccess ? prop->name : NULL);
    printf("\"totalGlobalMem\": %llu, \"major\": %d, \"minor\": %d, \"multiProcessorCount\": %d, ",
           (unsigned long long)prop->totalGlobalMem, prop->major, prop->minor, prop->multiProcessorCount);
    printf("\"warpSize\": %d, \"l2CacheSize\": %d, \"unifiedFunctionPointers\": %d, ", prop->warpSize,
           prop->l2CacheSize, prop->unifiedFunctionPointers);
    printf("\"maxGridSize\": [%d, %d, %d], ", prop->maxGridSize[0], prop->maxGridSize[1], prop->maxGridSize[2]);
    printf("\"fields\": {");
#define FIELD(f)                                                                \
    printf("%s\"%s\": [%zu, ", first ? "" : ", ", #f, offsetof(struct cudaDeviceProp, f)); \
    hex(&prop->f, sizeof prop->f);                                              \
    putchar(']');                                                               \
    first = 0;
    EDGEQ_PROP_COMMON_FIELDS(FIELD)
    printf("}, \"struct\": ");
    hex(prop, sizeof *prop);
    printf("}\n");
    return 0;
}
