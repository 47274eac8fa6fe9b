// Checkpoints of a private pool's layout, for CUDA graph trees (torch.compile's
// mode="reduce-overhead"): after recording a graph they save the pool's layout; before
// replaying another path of the tree they restore it, and every tensor the graphs expect is at
// its address again. PyTorch's rules: everything the pool has allocated is freed, then every
// checkpointed block is carved out of its segment again at its address (whatever
// max_split_size says now: the layout is the checkpoint's), and those free in the checkpoint
// are freed again.
#include <algorithm>

#include "allocator.h"
#include "text.h"

namespace allocwatch {

namespace {

[[noreturn]] void cannot_restore(const std::string& why) {
  throw std::runtime_error("allocwatch: cannot restore the private pool's checkpoint: " + why);
}

bool covers(const Block* b, std::uintptr_t address) {
  return b->ptr <= address && address < b->ptr + b->size;
}

}  // namespace

std::vector<const Block*> CachingAllocator::segment_heads(const PrivatePool& pool) const {
  // One head per contiguous mapped range of the pool's blocks, as snapshot() counts segments.
  std::vector<const Block*> heads;
  for (const Block* b : all_blocks()) {
    if (b->pool->owner != &pool || !b->mapped) continue;
    if (b->prev == nullptr || !b->prev->mapped) heads.push_back(b);
  }
  std::sort(heads.begin(), heads.end(),
            [](const Block* a, const Block* b) { return a->ptr < b->ptr; });
  return heads;
}

PoolCheckpoint CachingAllocator::checkpoint_pool(MempoolId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (captures_underway_.empty()) process_events_locked();
  const PrivatePool& pool = private_pool(id);
  PoolCheckpoint checkpoint;
  checkpoint.pool = id;
  for (const Block* head : segment_heads(pool)) {
    SegmentCheckpoint segment;
    segment.address = head->ptr;
    segment.stream = head->stream;
    segment.is_small = head->pool->is_small;
    segment.is_expandable = head->expandable != nullptr;
    for (const Block* b = head; b != nullptr && b->mapped; b = b->next) {
      if (!b->allocated && !b->is_free()) {
        Text msg;
        msg << "allocwatch: cannot checkpoint the private pool: the block at "
            << reinterpret_cast<const void*>(b->ptr)
            << " was freed but still waits for another stream's work (record_stream)";
        throw std::logic_error(msg.str());
      }
      segment.blocks.push_back(BlockCheckpoint{b->ptr, b->size, b->requested_size, b->allocated});
      segment.total_size += b->size;
    }
    checkpoint.segments.push_back(std::move(segment));
  }
  return checkpoint;
}

CheckpointRestore CachingAllocator::restore_pool(const PoolCheckpoint& checkpoint) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!captures_underway_.empty()) cannot_restore("a CUDA graph capture is underway");
  PrivatePool& pool = private_pool(checkpoint.pool);
  CheckpointRestore result;
  std::vector<Block*> live;
  allocated_.for_each([&](const Block* b) {
    if (b->pool->owner == &pool) live.push_back(const_cast<Block*>(b));
  });
  std::sort(live.begin(), live.end(), [](const Block* a, const Block* b) { return a->ptr < b->ptr; });
  for (Block* b : live) {
    result.freed.push_back(b->ptr);
    allocated_.erase(b->ptr);
    free_allocated(b);
  }
  // Blocks used on other streams wait for their events: the layout needs them free.
  process_events_locked();
  bool pending = false;
  for (const Block* b : all_blocks())
    if (b->pool->owner == &pool && b->mapped && !b->allocated && !b->is_free()) pending = true;
  if (pending) synchronize_and_free_events();
  for (const SegmentCheckpoint& segment : checkpoint.segments)
    restore_segment(pool, segment, result);
  return result;
}

void CachingAllocator::restore_segment(PrivatePool& pool, const SegmentCheckpoint& segment,
                                       CheckpointRestore& result) {
  BlockPool& blocks = segment.is_small ? pool.small_blocks : pool.large_blocks;
  Block* cover = nullptr;
  for (Block* b : blocks.blocks) {
    if (covers(b, segment.address)) {
      cover = b;
      break;
    }
  }
  if (cover == nullptr || cover->ptr + cover->size < segment.address + segment.total_size ||
      cover->stream != segment.stream) {
    Text msg;
    msg << "the segment at " << reinterpret_cast<const void*>(segment.address) << " ("
        << segment.total_size << " bytes) is no longer one free range of the pool";
    cannot_restore(msg.str());
  }
  // Cuts `size` bytes off the front of the free block `from` as an allocated block.
  auto carve = [&](Block* from, std::size_t size, std::size_t requested) {
    blocks.blocks.erase(from);
    AllocParams p{size, requested, from->stream, &blocks, size};
    p.block = from;
    return alloc_found_block(p, from->size > size);
  };
  std::vector<Block*> to_free;
  std::vector<Block*> kept;
  Block* next = cover;
  if (cover->ptr < segment.address) {
    // Pages mapped in front of the segment since the checkpoint stay free.
    Block* front = carve(cover, segment.address - cover->ptr, 0);
    to_free.push_back(front);
    next = front->next;
  }
  for (const BlockCheckpoint& saved : segment.blocks) {
    if (next == nullptr || next->ptr != saved.ptr || !next->is_free() || next->size < saved.size) {
      Text msg;
      msg << "the block at " << reinterpret_cast<const void*>(saved.ptr) << " (" << saved.size
          << " bytes) cannot be carved again";
      cannot_restore(msg.str());
    }
    Block* b = carve(next, saved.size, saved.requested_size);
    (saved.allocated ? kept : to_free).push_back(b);
    next = b->next;
  }
  for (Block* b : to_free) {
    allocated_.erase(b->ptr);
    free_allocated(b);
  }
  for (const Block* b : kept) result.allocated.emplace_back(b->ptr, b->size);
}

}  // namespace allocwatch
