// What a caller attaches to the allocator's history: an opaque context per trace entry (for
// PyTorch, the Python and C++ stack of the call, its compile context and user metadata), set
// for the duration of one allocator call on the calling thread.
//
// The core never looks inside a context: it only keeps it with the entries that the call
// records, so that whoever set it can read it back from trace() and the trace observers.
#pragma once

#include <memory>

namespace allocwatch {

// What a context handle points to: the caller's own struct, derived from this one and tagged
// with the address of something of the caller's, so that each reader of the history can tell
// its own contexts from others' (the Python binding's tests and the native back end can both
// have entries in one history).
struct TraceContext {
  explicit TraceContext(const void* owner) : owner(owner) {}
  const void* const owner;
};
using ContextHandle = std::shared_ptr<const TraceContext>;

// Sets the context of the trace entries recorded on this thread while the scope lives
// (nested scopes restore the outer one). Entries are recorded under the allocator's lock by
// the thread that called it, so a thread-local is exactly the call's context.
class TraceContextScope {
 public:
  explicit TraceContextScope(ContextHandle context);
  ~TraceContextScope();
  TraceContextScope(const TraceContextScope&) = delete;
  TraceContextScope& operator=(const TraceContextScope&) = delete;

  // The context of the innermost scope on this thread (empty outside any scope).
  static const ContextHandle& current();

 private:
  ContextHandle previous_;
};

}  // namespace allocwatch
