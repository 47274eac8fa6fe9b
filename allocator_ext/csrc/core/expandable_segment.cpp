#include "expandable_segment.h"

#include <algorithm>
#include <cassert>
#include <vector>

namespace allocwatch {

ExpandableSegment::ExpandableSegment(Device& device, StreamId stream, std::size_t address_space,
                                     std::size_t page_size)
    : device_(device),
      stream_(stream),
      page_size_(page_size),
      max_pages_((address_space + page_size - 1) / page_size) {
  // Alignment 0: the driver's granularity. Pages need no more (20 MiB pages could not ask for
  // theirs: the driver takes only power-of-two alignments).
  base_ = device_.reserve_address(page_size_ * max_pages_, 0);
}

ExpandableSegment::~ExpandableSegment() {
  // The allocator releases a segment only once every chunk is unmapped; this is a safety net
  // for teardown, where the device may already be gone, so errors are swallowed.
  try {
    for (const auto& [first, chunk] : chunks_) {
      device_.unmap(base_ + first * page_size_, chunk.pages * page_size_);
      device_.release_physical(chunk.handle, chunk.pages * page_size_);
    }
    device_.free_address(base_, page_size_ * max_pages_);
  } catch (...) {
  }
}

Range ExpandableSegment::map(Range r, std::size_t chunk_pages, std::vector<SparePhysical>* spare) {
  const std::size_t begin = page_floor(r.ptr);
  const std::size_t end = page_ceil(r.ptr + r.size);
  assert(base_ + begin * page_size_ == r.ptr);
  if (begin == end) return pages(begin, end);
  const std::size_t chunk = chunk_pages == 0 ? 1 : chunk_pages;
  if (spare != nullptr) {
    std::sort(spare->begin(), spare->end(), [](const SparePhysical& a, const SparePhysical& b) {
      return a.pages < b.pages;
    });
  }
  std::vector<std::size_t> made;     // first pages of chunks created here
  std::vector<std::size_t> reused;   // first pages of chunks that were spares
  auto give_back = [&]() {
    // Out of memory: release what this call created and return the spares it took, so that
    // nothing half-mapped remains.
    for (std::size_t f : made) {
      device_.release_physical(chunks_[f].handle, chunks_[f].pages * page_size_);
      chunks_.erase(f);
    }
    for (std::size_t f : reused) {
      spare->push_back(SparePhysical{chunks_[f].handle, chunks_[f].pages});
      chunks_.erase(f);
    }
  };
  std::size_t first = begin;
  while (spare != nullptr && !spare->empty() && spare->back().pages <= end - first) {
    chunks_[first] = Chunk{spare->back().handle, spare->back().pages};
    reused.push_back(first);
    first += spare->back().pages;
    spare->pop_back();
  }
  // New memory: chunks in the middle, single pages at both ends. Each end of a grown range
  // borders another block, and once that block is freed only whole free handles can be
  // given back: fine pages there leave little free memory pinned inside a chunk that is
  // partly in use (Note [page policy] in expandable.cpp, page size and chunks).
  const std::size_t chunks = chunk > 1 ? (end - first) / chunk : 0;
  const std::size_t singles = (end - first) - chunks * chunk;
  const std::size_t chunks_begin = first + (chunks > 0 ? singles / 2 : singles);
  const std::size_t chunks_end = chunks_begin + chunks * chunk;
  for (std::size_t n = 0; first < end; first += n) {
    n = first >= chunks_begin && first < chunks_end ? chunk : 1;
    PhysicalHandle handle = 0;
    if (!device_.create_physical(n * page_size_, &handle)) {
      give_back();
      return pages(begin, begin);
    }
    chunks_[first] = Chunk{handle, n};
    made.push_back(first);
  }
  std::vector<Device::Mapping> mappings;
  for (auto it = chunks_.lower_bound(begin); it != chunks_.end() && it->first < end; ++it)
    mappings.push_back({it->second.pages * page_size_, it->second.handle});
  device_.map_range(base_ + begin * page_size_, mappings);
  return pages(begin, end);
}

std::vector<std::map<std::size_t, ExpandableSegment::Chunk>::iterator>
ExpandableSegment::run_inside(Range r, std::size_t limit, std::size_t* bytes) {
  std::vector<std::map<std::size_t, Chunk>::iterator> run;
  *bytes = 0;
  const std::size_t lo = page_ceil(r.ptr);
  const std::size_t hi = page_floor(r.ptr + r.size);
  if (lo >= hi) return run;
  // Chunks tile the mapped pages, so those wholly inside [lo, hi) form one contiguous run.
  for (auto it = chunks_.lower_bound(lo); it != chunks_.end() && it->first + it->second.pages <= hi;
       ++it) {
    if (limit > 0 && *bytes >= limit) break;
    run.push_back(it);
    *bytes += it->second.pages * page_size_;
  }
  return run;
}

Range ExpandableSegment::unmap(Range r, std::size_t limit, std::vector<SparePhysical>* keep) {
  std::size_t bytes = 0;
  auto run = run_inside(r, limit, &bytes);
  if (run.empty()) return Range{r.ptr, 0};
  const std::size_t first = run.front()->first;
  for (auto it : run) {
    const std::size_t n = it->second.pages * page_size_;
    device_.unmap(base_ + it->first * page_size_, n);
    if (keep != nullptr) {
      keep->push_back(SparePhysical{it->second.handle, it->second.pages});
    } else {
      device_.release_physical(it->second.handle, n);
    }
    chunks_.erase(it);
  }
  return Range{base_ + first * page_size_, bytes};
}

Range ExpandableSegment::detach(Range r, std::size_t limit, std::vector<SparePhysical>* keep,
                                std::vector<Range>* still_mapped) {
  std::size_t bytes = 0;
  auto run = run_inside(r, limit, &bytes);
  if (run.empty()) return Range{r.ptr, 0};
  const std::size_t first = run.front()->first;
  for (auto it : run) {
    keep->push_back(SparePhysical{it->second.handle, it->second.pages});
    still_mapped->push_back(Range{base_ + it->first * page_size_, it->second.pages * page_size_});
    chunks_.erase(it);
  }
  return Range{base_ + first * page_size_, bytes};
}

std::vector<ExpandableSegment::MappedChunk> ExpandableSegment::chunks_in(Range r) const {
  std::vector<MappedChunk> out;
  if (r.size == 0) return out;
  const std::size_t begin = page_floor(r.ptr), end = page_ceil(r.ptr + r.size);
  auto it = chunks_.upper_bound(begin);
  if (it != chunks_.begin()) --it;  // the chunk that may start before r
  for (; it != chunks_.end() && it->first < end; ++it) {
    if (it->first + it->second.pages <= begin) continue;
    out.push_back(MappedChunk{base_ + it->first * page_size_, it->second.pages * page_size_,
                              it->second.handle});
  }
  return out;
}

std::size_t ExpandableSegment::mapped_bytes() const {
  std::size_t n = 0;
  for (const auto& [first, chunk] : chunks_) n += chunk.pages * page_size_;
  return n;
}

}  // namespace allocwatch
