#include "devices/cuda_event_pool.h"

namespace allocwatch {
namespace cuda {

EventPool::~EventPool() { destroy_idle(); }

void EventPool::destroy_idle() noexcept {
  // At process exit the driver may already be shut down (CUDA_ERROR_DEINITIALIZED); the
  // events die with the context then, so errors are ignored.
  std::lock_guard<std::mutex> lock(mutex_);
  for (CUevent event : idle_) driver_.cuEventDestroy(event);
  idle_.clear();
}

CUevent EventPool::acquire() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      CUevent event = idle_.back();
      idle_.pop_back();
      return event;
    }
  }
  CUevent event = nullptr;
  check_result(driver_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  return event;
}

void EventPool::release(CUevent event) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(event);
}

}  // namespace cuda
}  // namespace allocwatch
