// Private pools beyond CUDA graph capture: torch.cuda.MemPool makes a pool (its segments from
// an allocator of its own, where it has one), shares it (use counts), routes a thread's
// allocations to it (begin/end_allocate_to_pool), asks for unsplit blocks, lends its free
// blocks to requests about to run out of memory (use_on_oom), releases its cache, and CUDA
// graph trees check which of its blocks are still allocated. During a capture, blocks freed while other streams used them are reused
// where the capture's graph orders those uses (capture_graphs.h). Also: which allocation a
// pointer belongs to (getBaseAllocation, IPC).
#include <algorithm>
#include <unordered_set>

#include "allocator.h"
#include "expandable_segment.h"
#include "text.h"

namespace allocwatch {

namespace {

std::string pool_name(MempoolId id) {
  Text t;
  t << "(" << id.first << ", " << id.second << ")";
  return t.str();
}

}  // namespace

PrivatePool& CachingAllocator::private_pool(MempoolId id) const {
  auto it = graph_pools_.find(id);
  if (it == graph_pools_.end())
    throw std::invalid_argument("allocwatch: no private pool " + pool_name(id));
  return *it->second;
}

void CachingAllocator::create_or_incref_pool(MempoolId id, bool plain_segments,
                                             std::shared_ptr<Device> segments) {
  std::lock_guard<std::mutex> lock(mutex_);
  create_or_incref_pool_locked(id, plain_segments, std::move(segments));
}

void CachingAllocator::create_or_incref_pool_locked(MempoolId id, bool plain_segments,
                                                    std::shared_ptr<Device> segments) {
  auto it = graph_pools_.find(id);
  if (it == graph_pools_.end()) {
    auto pool = std::make_unique<PrivatePool>();
    // An allocator of the pool's own hands out whole allocations: never expandable segments.
    pool->plain_segments = plain_segments || segments != nullptr;
    pool->segments = std::move(segments);
    graph_pools_.emplace(id, std::move(pool));
    return;
  }
  if (segments != nullptr)
    throw std::logic_error("allocwatch: private pool " + pool_name(id) +
                           " exists already: its allocator cannot be chosen again");
  // A pool already released by all its users may not be revived: its blocks are on their way
  // back to the device.
  if (it->second->use_count <= 0)
    throw std::logic_error("allocwatch: private pool " + pool_name(id) + " was already released");
  it->second->use_count++;
}

int CachingAllocator::pool_use_count(MempoolId id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = graph_pools_.find(id);
  return it == graph_pools_.end() ? 0 : it->second->use_count;
}

void CachingAllocator::set_pool_no_split(MempoolId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  private_pool(id).no_split = true;
}

void CachingAllocator::set_pool_use_on_oom(MempoolId id, bool use_on_oom) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto at = std::find(use_on_oom_pools_.begin(), use_on_oom_pools_.end(), id);
  if (!use_on_oom) {
    if (at != use_on_oom_pools_.end()) use_on_oom_pools_.erase(at);
    return;
  }
  private_pool(id);  // an unknown pool is refused, changing nothing
  if (at == use_on_oom_pools_.end()) use_on_oom_pools_.push_back(id);
}

bool CachingAllocator::get_free_block_of_use_on_oom_pools(AllocParams& p) {
  for (auto at = use_on_oom_pools_.begin(); at != use_on_oom_pools_.end();) {
    auto it = graph_pools_.find(*at);
    if (it == graph_pools_.end()) {  // released and emptied since: its mark goes with it
      at = use_on_oom_pools_.erase(at);
      continue;
    }
    // A pool all its users released is on its way back to the device (PyTorch would assert).
    if (it->second->use_count > 0) {
      PrivatePool& pool = *it->second;
      p.pool = is_small_request(p.size) ? &pool.small_blocks : &pool.large_blocks;
      if (get_free_block(p)) return true;
    }
    ++at;
  }
  return false;
}

std::size_t CachingAllocator::empty_pool_cache(MempoolId id) {
  Lock lock(*this);
  // As empty_cache: releasing during a capture would invalidate it.
  if (captures_underway()) return 0;
  auto it = graph_pools_freeable_.find(id);
  if (it == graph_pools_freeable_.end()) return 0;  // unknown, or still in use
  process_events_locked();
  PrivatePool* pool = it->second;
  const std::size_t released = release_blocks(pool->small_blocks) + release_blocks(pool->large_blocks);
  if (pool->holds_no_memory()) {
    graph_pools_freeable_.erase(it);
    drop_pool(id);
  }
  return released;
}

void CachingAllocator::drop_pool(MempoolId id) {
  auto it = graph_pools_.find(id);
  if (it == graph_pools_.end()) return;
  if (it->second->segments != nullptr)
    outside_.push_back(OutsideWork{std::move(it->second->segments), nullptr, 0});
  graph_pools_.erase(it);
}

bool CachingAllocator::check_pool_live_allocations(
    MempoolId id, const std::vector<std::uintptr_t>& expected) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const PrivatePool* pool = &private_pool(id);
  const std::unordered_set<std::uintptr_t> wanted(expected.begin(), expected.end());
  std::size_t live = 0;
  bool unexpected = false;
  allocated_.for_each([&](const Block* b) {
    if (b->pool->owner != pool) return;
    ++live;
    if (wanted.count(b->ptr) == 0) unexpected = true;
  });
  return !unexpected && live == wanted.size();
}

void CachingAllocator::set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs) {
  std::lock_guard<std::mutex> lock(mutex_);
  capture_graphs_ = std::move(graphs);
}

void CachingAllocator::note_freed_in_capture(Block* block) {
  // The capture's current terminals on each stream the block was used on are its last uses
  // there. A stream that is not capturing has uses the graph does not order: the block waits
  // for the capture's end, as without reuse.
  if (!capture_graphs_) return;
  std::vector<std::uintptr_t> last_uses, on_stream;
  if (!capture_graphs_->terminals(block->stream, &last_uses)) return;
  for (StreamId s : block->stream_uses) {
    if (!capture_graphs_->terminals(s, &on_stream)) return;
    last_uses.insert(last_uses.end(), on_stream.begin(), on_stream.end());
  }
  // No node used it yet (streams that only just joined the capture): nothing orders its
  // uses, so it waits for the capture's end.
  if (last_uses.empty()) return;
  std::sort(last_uses.begin(), last_uses.end());
  last_uses.erase(std::unique(last_uses.begin(), last_uses.end()), last_uses.end());
  freed_in_capture_[block] = std::move(last_uses);
}

void CachingAllocator::reuse_freed_in_capture(StreamId stream) {
  // A block serves its own stream again once the stream's captured work follows every last
  // use: no event (none can be queried during a capture), the graph orders them.
  if (!capture_graphs_ || captures_underway_.empty()) return;
  std::vector<Block*> reusable;
  for (const auto& [block, last_uses] : freed_in_capture_) {
    if (block->stream == stream && capture_graphs_->precede(stream, last_uses))
      reusable.push_back(block);
  }
  if (reusable.empty()) return;
  auto& deferred = needs_events_deferred_until_no_capture_;
  for (Block* block : reusable) {
    freed_in_capture_.erase(block);
    deferred.erase(std::remove(deferred.begin(), deferred.end(), block), deferred.end());
    block_to_capture_stream_uses_.erase(block);
    block->stream_uses.clear();
    free_block(block);
  }
}

SegmentSpan CachingAllocator::segment_of(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* block = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (block == nullptr) return SegmentSpan{};
  // An expandable segment's pages come and go: only the block itself is a stable allocation.
  if (block->expandable != nullptr) return SegmentSpan{block->ptr, block->size, true};
  const Block* head = block;
  while (head->prev != nullptr) head = head->prev;
  std::size_t size = 0;
  for (const Block* b = head; b != nullptr; b = b->next) size += b->size;
  return SegmentSpan{head->ptr, size, false};
}

IpcExport CachingAllocator::export_ipc(const void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* block = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (block == nullptr || block->expandable == nullptr)
    throw std::invalid_argument("allocwatch: not an allocated block of an expandable segment");
  IpcExport out;
  for (const auto& chunk : block->expandable->chunks_in(Range{block->ptr, block->size})) {
    if (out.pieces.empty()) out.offset = block->ptr - chunk.ptr;
    const int fd = device_->export_physical(chunk.handle);
    if (fd < 0) {
      throw DeviceError("the device made this memory without a shareable handle (the driver "
                        "or the container does not permit them)");
    }
    out.pieces.emplace_back(fd, chunk.size);
  }
  return out;
}

}  // namespace allocwatch
