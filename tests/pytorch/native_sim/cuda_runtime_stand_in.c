/* A stand-in for the few CUDA runtime calls that c10 and the native back end make on the paths
 * tests/pytorch/test_native_sim.py drives: one device, nothing ever captured, no work to wait
 * for. Preloaded (LD_PRELOAD) over the real libcudart, which cannot answer without a GPU; the
 * allocations themselves go to allocwatch's simulated device (ALLOCWATCH_SHIM_DEVICE=sim). */
#include <stddef.h>

int cudaGetDevice(int* device) { *device = 0; return 0; }
int cudaSetDevice(int device) { (void)device; return 0; }
int cudaGetDeviceCount(int* count) { *count = 1; return 0; }
int cudaGetLastError(void) { return 0; }
int cudaPeekAtLastError(void) { return 0; }
int cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -1;
  return 0;
}
int cudaStreamIsCapturing(void* stream, int* status) { (void)stream; *status = 0; return 0; }
int cudaThreadExchangeStreamCaptureMode(int* mode) { (void)mode; return 0; }
int cudaDriverGetVersion(int* version) { *version = 13000; return 0; }
int cudaRuntimeGetVersion(int* version) { *version = 13000; return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaStreamSynchronize(void* stream) { (void)stream; return 0; }
