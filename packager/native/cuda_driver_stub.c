/*
 * Stand-in for the NVIDIA driver library (libcuda.so.1) on build hosts without a GPU.
 *
 * TVM's CUDA backend (libtvm_runtime_cuda.so) links libcuda.so.1. Without it that library does not
 * load, TVM never calls the CUDA compile callback, and exported libraries carry CUDA *source* that no
 * device can load. edgeq compiles this file and loads it (RTLD_GLOBAL, soname libcuda.so.1) before
 * importing TVM on machines that have no driver. Every entry point reports CUDA_ERROR_NO_DEVICE (100),
 * so nothing can run on it: it only lets code generation proceed. CUDA's own stubs/libcuda.so serves
 * the same purpose. The symbol list is `nm -D --undefined-only libtvm_runtime_cuda.so | grep ' cu[A-Z]'`.
 */
#define EDGEQ_NO_DEVICE(name) int name(void) { return 100; }
EDGEQ_NO_DEVICE(cuDeviceGetName)
EDGEQ_NO_DEVICE(cuFuncSetAttribute)
EDGEQ_NO_DEVICE(cuGetErrorName)
EDGEQ_NO_DEVICE(cuGetErrorString)
EDGEQ_NO_DEVICE(cuLaunchKernelEx)
EDGEQ_NO_DEVICE(cuModuleGetFunction)
EDGEQ_NO_DEVICE(cuModuleLoadData)
EDGEQ_NO_DEVICE(cuModuleUnload)
EDGEQ_NO_DEVICE(cuTensorMapEncodeTiled)
EDGEQ_NO_DEVICE(cuDriverGetVersion)
