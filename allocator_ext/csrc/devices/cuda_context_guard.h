// Makes a context current on the calling thread for the length of one driver call.
//
// The driver acts on the thread's current context. PyTorch's threads (autograd, data loader
// pinning, a user's own) may have none current, or another device's; making ours current and
// restoring the previous one afterwards is what c10::cuda::CUDAGuard does for the runtime.
#pragma once

#include "devices/cuda_driver.h"

namespace allocwatch {
namespace cuda {

class ContextGuard {
 public:
  ContextGuard(const CudaDriver& driver, CUcontext context) : driver_(driver) {
    CUresult result = driver_.cuCtxGetCurrent(&previous_);
    // After the driver shut down (process exit) no context can be made current; the call
    // this guards then fails with the same error, which release calls accept.
    if (result == CUDA_ERROR_DEINITIALIZED) return;
    check_result(result, "cuCtxGetCurrent");
    if (previous_ != context) {
      check_result(driver_.cuCtxSetCurrent(context), "cuCtxSetCurrent");
      switched_ = true;
    }
  }
  ~ContextGuard() {
    // A thread that had no context keeps ours: that is what the runtime would bind anyway,
    // and it saves a call next time. Errors cannot be thrown from here; none is expected.
    if (switched_ && previous_ != nullptr) driver_.cuCtxSetCurrent(previous_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const CudaDriver& driver_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

}  // namespace cuda
}  // namespace allocwatch
