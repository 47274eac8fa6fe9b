#include "unmapper.h"

#include <unistd.h>

namespace allocwatch {

Unmapper::~Unmapper() {
  if (!thread_) return;
  if (getpid() != owner_) {
    // A forked child copied the object, not the thread: nothing to join.
    (void)thread_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_one();
  thread_->join();  // what was queued is unmapped first
}

std::uint64_t Unmapper::submit(std::vector<Range> ranges) {
  std::uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = ++submitted_;
    queue_.emplace_back(ticket, std::move(ranges));
    if (!thread_ || owner_ != getpid()) {
      // A forked child copied the object, not the thread: it starts its own.
      if (thread_) (void)thread_.release();
      owner_ = getpid();
      thread_ = std::make_unique<std::thread>([this] { run(); });
    }
  }
  work_.notify_one();
  return ticket;
}

void Unmapper::wait(std::uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) >= ticket; });
  lock.unlock();
  rethrow_error();
}

void Unmapper::rethrow_error() {
  if (!failed_.load(std::memory_order_acquire)) return;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = std::exchange(error_, nullptr);
    failed_.store(false, std::memory_order_release);
  }
  if (error) std::rethrow_exception(error);
}

namespace {
thread_local bool t_on_unmapper_thread = false;
}  // namespace

bool Unmapper::on_this_thread() { return t_on_unmapper_thread; }

void Unmapper::run() {
  t_on_unmapper_thread = true;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    auto [ticket, ranges] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    for (const Range& r : ranges) {
      try {
        device_.unmap(r.ptr, r.size);
        unmaps_.fetch_add(1, std::memory_order_relaxed);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    lock.lock();
    if (error && !error_) {
      error_ = error;
      failed_.store(true, std::memory_order_release);
    }
    done_.store(ticket, std::memory_order_release);
    finished_.notify_all();
  }
}

}  // namespace allocwatch
