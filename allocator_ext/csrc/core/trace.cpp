#include "trace.h"

namespace allocwatch {

const char* trace_action_name(TraceAction a) {
  switch (a) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::snapshot: return "snapshot";
    case TraceAction::oom: return "oom";
  }
  return "unknown";
}

bool trace_action_from_name(const std::string& name, TraceAction* action) {
  for (TraceAction a : {TraceAction::alloc, TraceAction::free_requested,
                        TraceAction::free_completed, TraceAction::segment_alloc,
                        TraceAction::segment_free, TraceAction::segment_map,
                        TraceAction::segment_unmap, TraceAction::snapshot, TraceAction::oom}) {
    if (name == trace_action_name(a)) {
      *action = a;
      return true;
    }
  }
  return false;
}

}  // namespace allocwatch
