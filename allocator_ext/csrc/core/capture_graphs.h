// What the core asks about the CUDA graphs being captured, to reuse during a capture a block
// that was freed while other streams of the capture still used it (PyTorch's
// graph_capture_record_stream_reuse). Without it such a block waits for the capture's end.
//
// The graph's own topology orders the uses, so no event is needed: the block may serve a new
// request on its stream once every node that last used it (on each of its streams) is among
// the ancestors of that stream's current capture terminals — everything captured on the stream
// from then on runs after those uses. The caller (the native back end, through the CUDA
// runtime) answers; nodes are opaque to the core.
#pragma once

#include <cstdint>
#include <vector>

#include "device.h"

namespace allocwatch {

class CaptureGraphs {
 public:
  virtual ~CaptureGraphs() = default;
  // Whether `stream` is being captured (false too where reuse is off), and the nodes the next
  // work captured on it will depend on (its capture's terminals, none right after it began).
  // Must not throw.
  virtual bool terminals(StreamId stream, std::vector<std::uintptr_t>* out) = 0;
  // Whether every one of `nodes` is an ancestor (or one) of `stream`'s current capture
  // terminals. Must not throw; false when unsure.
  virtual bool precede(StreamId stream, const std::vector<std::uintptr_t>& nodes) = 0;
};

}  // namespace allocwatch
