// The capture graphs' topology, for reusing during a capture blocks whose last uses the graph
// has ordered (PyTorch's graph_capture_record_stream_reuse, read from PyTorch's own settings on
// every question, as its allocator reads it; core/capture_graphs.h says the rule). Called under
// a device allocator's lock: runtime calls only, no GIL, and nothing thrown (an error is "not
// capturing" or "not yet": the block then waits for the capture's end).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/capture_graphs.h"

namespace allocwatch::native_backend {

class TorchCaptureGraphs final : public CaptureGraphs {
 public:
  bool terminals(StreamId stream, std::vector<std::uintptr_t>* out) override;
  bool precede(StreamId stream, const std::vector<std::uintptr_t>& nodes) override;
  // A capture that ended: what was walked of its graph goes.
  void forget_ended();

 private:
  struct Capture {
    unsigned long long id = 0;
    std::vector<std::uintptr_t> terminals;
  };
  struct KeyHash {
    std::size_t operator()(const std::pair<unsigned long long, StreamId>& k) const {
      return std::hash<unsigned long long>()(k.first) * 31 + std::hash<StreamId>()(k.second);
    }
  };

  bool walked_to(StreamId stream, const std::vector<std::uintptr_t>& nodes);
  static bool reuse_on();
  static bool capture_of(StreamId stream, Capture* out);
  static bool dependencies(cudaGraphNode_t node, cudaGraphNode_t* out, std::size_t* count);

  std::mutex mutex_;
  std::unordered_map<std::pair<unsigned long long, StreamId>, std::unordered_set<std::uintptr_t>,
                     KeyHash>
      ancestors_;
};

}  // namespace allocwatch::native_backend
