#include "ipc.h"

#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core_link.h"

// Older C library headers lack these (the numbers are those of every 64-bit Linux).
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY (static_cast<unsigned long>(-1))
#endif

namespace allocwatch::native_backend {

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

constexpr char kCudaMallocHandle = 'c';
constexpr char kExpandableHandle = 'e';
// An expandable block's handle: 'e', the sender's pid, a serial (file descriptor numbers are
// reused once closed: the serial keeps a new export from matching a cached old one), the
// block's offset in the first piece, the count, then each piece's size and descriptor.
struct ExpandableHeader {
  std::int32_t pid;
  std::uint32_t count;
  std::uint64_t serial;
  std::uint64_t offset;
};
struct ExpandablePiece {
  std::uint64_t size;
  std::int32_t fd;
};

}  // namespace

cca::ShareableHandle IpcSharing::share(void* ptr) {
  const SegmentSpan span = g_core->segment_of(ptr);
  TORCH_CHECK(span.size > 0, "invalid device pointer: ", ptr);
  if (span.expandable) return share_expandable(ptr);
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(span.base)));
  std::string bytes(1, kCudaMallocHandle);
  bytes.append(reinterpret_cast<const char*>(&handle), CUDA_IPC_HANDLE_SIZE);
  return cca::ShareableHandle{
      static_cast<std::ptrdiff_t>(reinterpret_cast<std::uintptr_t>(ptr) - span.base), bytes};
}

std::shared_ptr<void> IpcSharing::open(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = opened_.find(handle);
  if (it != opened_.end()) {
    if (auto ptr = it->second.lock()) return ptr;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  std::shared_ptr<void> opened;
  if (!handle.empty() && handle[0] == kExpandableHandle) {
    const auto [mapping, block] = import_expandable(device, handle);
    opened = std::shared_ptr<void>(reinterpret_cast<void*>(block),
                                   [this, handle, device, mapping = mapping](void*) {
                                     g_core->close_ipc(device, mapping);
                                     forget(handle);
                                   });
  } else {
    TORCH_CHECK(handle.size() == 1 + CUDA_IPC_HANDLE_SIZE && handle[0] == kCudaMallocHandle,
                "allocwatch: not a CUDA IPC handle this allocator made (", handle.size(),
                " bytes); the sending process must run allocwatch's allocator too");
    cudaIpcMemHandle_t ipc_handle;
    std::memcpy(&ipc_handle, handle.data() + 1, CUDA_IPC_HANDLE_SIZE);
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, ipc_handle, cudaIpcMemLazyEnablePeerAccess));
    opened = std::shared_ptr<void>(ptr, [this, handle, device](void* p) {
      {
        c10::cuda::CUDAGuard guard(device);
        (void)cudaIpcCloseMemHandle(p);  // at exit the context may be gone already
      }
      forget(handle);
    });
  }
  opened_[handle] = opened;
  return opened;
}

cca::ShareableHandle IpcSharing::share_expandable(void* ptr) {
  static std::once_flag allow_ptrace;
  if (const char* who = std::getenv("ALLOCWATCH_IPC_PTRACER"); who && std::strcmp(who, "any") == 0)
    std::call_once(allow_ptrace, [] { prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); });
  core::Failure failure;
  const IpcExport exported = g_core->export_ipc(ptr, &failure);
  TORCH_CHECK(!failure, "allocwatch cannot share this tensor of an expandable segment with "
              "another process (", failure.message, "): allocate the tensors you share with "
              "expandable_segments:False (torch.cuda.memory._set_allocator_settings("
              "\"expandable_segments:False\") before creating them, or "
              "ALLOCWATCH_ALLOC_CONF=expandable_segments:False for the sending process)");
  static std::atomic<std::uint64_t> serial{0};
  ExpandableHeader header{static_cast<std::int32_t>(getpid()),
                          static_cast<std::uint32_t>(exported.pieces.size()), ++serial,
                          exported.offset};
  std::string bytes(1, kExpandableHandle);
  bytes.append(reinterpret_cast<const char*>(&header), sizeof header);
  for (const auto& [fd, size] : exported.pieces) {
    ExpandablePiece piece{size, fd};
    bytes.append(reinterpret_cast<const char*>(&piece), sizeof piece);
  }
  // The block itself is the allocation shared (getBaseAllocation): its offset is 0.
  return cca::ShareableHandle{0, bytes};
}

std::pair<std::uintptr_t, std::uintptr_t> IpcSharing::import_expandable(
    c10::DeviceIndex device, const std::string& handle) {
  ExpandableHeader header{};
  TORCH_CHECK(handle.size() >= 1 + sizeof header, "allocwatch: a truncated IPC handle");
  std::memcpy(&header, handle.data() + 1, sizeof header);
  TORCH_CHECK(handle.size() == 1 + sizeof header + header.count * sizeof(ExpandablePiece),
              "allocwatch: a malformed IPC handle");
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, header.pid, 0));
  TORCH_CHECK(pidfd >= 0, "allocwatch: cannot reach the process that shares this tensor (pid ",
              header.pid, "): pidfd_open: ", std::strerror(errno),
              " (Linux 5.6 or later is needed to share expandable segments; or set "
              "expandable_segments:False in the sending process)");
  std::vector<std::pair<int, std::size_t>> pieces;
  std::string taken_error;
  for (std::uint32_t i = 0; i < header.count; ++i) {
    ExpandablePiece piece{};
    std::memcpy(&piece, handle.data() + 1 + sizeof header + i * sizeof piece, sizeof piece);
    const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, piece.fd, 0));
    if (fd < 0) {
      taken_error = std::strerror(errno);
      break;
    }
    pieces.emplace_back(fd, piece.size);
  }
  close(pidfd);
  core::Failure failure;
  std::uintptr_t base = 0;
  if (taken_error.empty()) base = g_core->import_ipc(device, pieces, &failure);
  for (const auto& [fd, size] : pieces) close(fd);
  TORCH_CHECK(taken_error.empty(), "allocwatch: cannot take over the memory that process ",
              header.pid, " shares (pidfd_getfd: ", taken_error, "; the kernel lets a process "
              "do that only where it may ptrace the other, see kernel.yama.ptrace_scope, or "
              "where the sender runs with ALLOCWATCH_IPC_PTRACER=any): set "
              "expandable_segments:False in the sending process to share through cudaIpc "
              "handles instead (docs/torch.md, CUDA IPC)");
  check(failure);
  return {base, base + header.offset};
}

void IpcSharing::forget(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  opened_.erase(handle);
}

}  // namespace allocwatch::native_backend
