#include "history.h"

#include <utility>

namespace allocwatch {

namespace {
thread_local ContextHandle t_current;
}  // namespace

TraceContextScope::TraceContextScope(ContextHandle context)
    : previous_(std::exchange(t_current, std::move(context))) {}

TraceContextScope::~TraceContextScope() { t_current = std::move(previous_); }

const ContextHandle& TraceContextScope::current() { return t_current; }

}  // namespace allocwatch
