// CUDA IPC: tensors shared with other processes (torch.multiprocessing). Ordinary segments are
// shared with cudaIpc handles (the handle is that of the whole segment, the offset the block's
// place in it), as PyTorch does. A block of an expandable segment is shared as the physical
// allocations under it, exported as file descriptors that the receiving process takes over
// with pidfd_getfd (docs/torch.md, CUDA IPC).
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace allocwatch::native_backend {

class IpcSharing {
 public:
  // shareIpcHandle: a handle another process opens for the allocated block at `ptr`.
  c10::cuda::CUDACachingAllocator::ShareableHandle share(void* ptr);
  // getIpcDevPtr: the memory another process shared, mapped here once per handle while used.
  std::shared_ptr<void> open(const std::string& handle);

 private:
  c10::cuda::CUDACachingAllocator::ShareableHandle share_expandable(void* ptr);
  // Maps the pieces of another process's expandable block; returns where the mapping and the
  // block start here. Under mutex_.
  std::pair<std::uintptr_t, std::uintptr_t> import_expandable(c10::DeviceIndex device,
                                                              const std::string& handle);
  void forget(const std::string& handle);

  std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

}  // namespace allocwatch::native_backend
