// Unmapping on a thread of its own: the old places of moved pages (Note [moving pages]).
//
// An unmap is a driver call of 20-40 us a mapping (docs/benchmarks.md, "Device-call costs"),
// and a page move unmaps its old place once the device is done with it. Made inline, in the
// allocation that finds the move's events complete, that is host time in the training loop:
// a pipeline that moves a few pages a step spent most of its priced calls on them. The move's
// new place is needed now, so mapping it stays inline; the old place is needed by nobody until
// its address space is reused, so its unmap can wait for a thread that does nothing else.
//
// The allocator hands over the ranges with submit() and keeps them out of use until done()
// says their ticket is through; tickets finish in the order given. Nothing here takes the
// allocator's lock, and the allocating thread never waits for the thread, but in wait(), which
// a release of the whole cache (an explicit reclaim, a last retry; each waits on the host
// anyway) uses, counted as num_host_waits.unmap_thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "device.h"
#include "expandable_segment.h"

namespace allocwatch {

class Unmapper {
 public:
  explicit Unmapper(Device& device) : device_(device) {}
  ~Unmapper();
  Unmapper(const Unmapper&) = delete;
  Unmapper& operator=(const Unmapper&) = delete;

  // Queues `ranges` to be unmapped; returns their ticket (1, 2, ...). The thread starts with
  // the first.
  std::uint64_t submit(std::vector<Range> ranges);
  // Whether every range of `ticket` (and of those before it) is unmapped. Rethrows, once, a
  // DeviceError the thread met: the caller's allocation fails as an inline unmap's would.
  bool done(std::uint64_t ticket) {
    rethrow_error();
    return ticket <= done_.load(std::memory_order_acquire);
  }
  // Blocks until `ticket` is through (a host wait).
  void wait(std::uint64_t ticket);
  // Whether the calling thread is an Unmapper's (a device that counts calls tells them apart).
  static bool on_this_thread();
  // Unmap calls the thread has made so far (one a range; a range may span several mappings).
  std::int64_t unmaps() const { return unmaps_.load(std::memory_order_relaxed); }

 private:
  void run();
  void rethrow_error();

  Device& device_;
  std::mutex mutex_;
  std::condition_variable work_;      // to the thread: something queued, or stop
  std::condition_variable finished_;  // from the thread: done_ moved
  std::deque<std::pair<std::uint64_t, std::vector<Range>>> queue_;  // under mutex_
  std::uint64_t submitted_ = 0;                                     // under mutex_
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::int64_t> unmaps_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // under mutex_
  bool stop_ = false;         // under mutex_
  std::unique_ptr<std::thread> thread_;
  pid_t owner_ = 0;  // the process that started the thread (a forked child has none)
};

}  // namespace allocwatch
