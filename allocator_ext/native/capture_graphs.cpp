#include "capture_graphs.h"

#include <c10/cuda/CUDAAllocatorConfig.h>

#include <algorithm>
#include <iterator>

namespace allocwatch::native_backend {

bool TorchCaptureGraphs::terminals(StreamId stream, std::vector<std::uintptr_t>* out) {
  try {
    Capture capture;
    if (!reuse_on() || !capture_of(stream, &capture)) return false;
    *out = std::move(capture.terminals);
    return true;
  } catch (...) {
    return false;
  }
}

bool TorchCaptureGraphs::precede(StreamId stream, const std::vector<std::uintptr_t>& nodes) {
  try {
    return walked_to(stream, nodes);
  } catch (...) {
    return false;
  }
}

void TorchCaptureGraphs::forget_ended() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = ancestors_.begin(); it != ancestors_.end();) {
    Capture capture;
    const bool live = capture_of(it->first.second, &capture) && capture.id == it->first.first;
    it = live ? std::next(it) : ancestors_.erase(it);
  }
}

bool TorchCaptureGraphs::walked_to(StreamId stream, const std::vector<std::uintptr_t>& nodes) {
  Capture capture;
  if (!reuse_on() || !capture_of(stream, &capture) || capture.terminals.empty()) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  // Ancestors of a stream's terminals stay its ancestors as the capture grows: each graph and
  // stream is walked once, from the nodes added since.
  auto& seen = ancestors_[{capture.id, stream}];
  std::vector<cudaGraphNode_t> walk;
  for (std::uintptr_t t : capture.terminals) walk.push_back(reinterpret_cast<cudaGraphNode_t>(t));
  while (!walk.empty()) {
    cudaGraphNode_t node = walk.back();
    walk.pop_back();
    if (!seen.insert(reinterpret_cast<std::uintptr_t>(node)).second) continue;
    std::size_t count = 0;
    if (!dependencies(node, nullptr, &count)) return false;
    std::vector<cudaGraphNode_t> parents(count);
    if (count > 0 && !dependencies(node, parents.data(), &count)) return false;
    walk.insert(walk.end(), parents.begin(), parents.begin() + static_cast<long>(count));
  }
  return std::all_of(nodes.begin(), nodes.end(),
                     [&](std::uintptr_t n) { return seen.count(n) > 0; });
}

bool TorchCaptureGraphs::reuse_on() {
  return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
}

bool TorchCaptureGraphs::capture_of(StreamId stream, Capture* out) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  std::size_t count = 0;
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaStreamGetCaptureInfo(reinterpret_cast<cudaStream_t>(stream), &status,
                                                   &out->id, &graph, &deps, nullptr, &count);
#else
  const cudaError_t err = cudaStreamGetCaptureInfo_v2(reinterpret_cast<cudaStream_t>(stream),
                                                      &status, &out->id, &graph, &deps, &count);
#endif
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaStreamCaptureStatusActive) return false;
  out->terminals.clear();
  for (std::size_t i = 0; i < count; ++i)
    out->terminals.push_back(reinterpret_cast<std::uintptr_t>(deps[i]));
  return true;
}

bool TorchCaptureGraphs::dependencies(cudaGraphNode_t node, cudaGraphNode_t* out,
                                      std::size_t* count) {
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaGraphNodeGetDependencies(node, out, nullptr, count);
#else
  const cudaError_t err = cudaGraphNodeGetDependencies(node, out, count);
#endif
  if (err == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

}  // namespace allocwatch::native_backend
