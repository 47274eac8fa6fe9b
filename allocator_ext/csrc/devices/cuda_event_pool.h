// A pool of CUDA events created once and reused, so that recording an event on a stream (which
// the allocator does for every cross-stream free) costs one cuEventRecord, not a create and a
// destroy. Events are created with timing disabled: cheaper to record and to query.
#pragma once

#include <mutex>
#include <vector>

#include "devices/cuda_driver.h"

namespace allocwatch {
namespace cuda {

class EventPool {
 public:
  explicit EventPool(const CudaDriver& driver) : driver_(driver) {}
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // An idle event, created if none is left. The caller's context must be current.
  CUevent acquire();
  // Gives an event back for reuse. Its last record need not have completed: re-recording an
  // event is allowed at any time, and a query then reflects only the newest record.
  void release(CUevent event);
  // Destroys every idle event; errors are ignored (used on shutdown, when the driver may
  // already be gone). Call while the events' context still exists.
  void destroy_idle() noexcept;

 private:
  const CudaDriver& driver_;
  std::mutex mutex_;  // the core calls under its own lock, but events may also be freed from
                      // other threads (PyTorch's record_stream path), so the pool guards itself
  std::vector<CUevent> idle_;
};

}  // namespace cuda
}  // namespace allocwatch
