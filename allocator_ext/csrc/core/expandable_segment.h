// An expandable segment: a large range of reserved address space into which physical pages
// are mapped on demand and unmapped when reclaimed (PyTorch's "expandable_segments").
//
// Growing a segment in place lets tensors of slowly changing sizes tile one range instead of
// leaving a sliver at the end of many fixed-size segments. The cost is device calls: each page
// is created, mapped and given access, and later unmapped and released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "device.h"

namespace allocwatch {

struct Range {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;
};

// Physical memory unmapped from one place to be mapped at another: a handle of `pages` pages
// (any page-aligned address with that much room will take it; the driver maps a handle only
// whole).
struct SparePhysical {
  PhysicalHandle handle;
  std::size_t pages;
};

class ExpandableSegment {
 public:
  ExpandableSegment(Device& device, StreamId stream, std::size_t address_space,
                    std::size_t page_size);
  ~ExpandableSegment();
  ExpandableSegment(const ExpandableSegment&) = delete;
  ExpandableSegment& operator=(const ExpandableSegment&) = delete;

  // Maps the pages covering [r.ptr, r.ptr + r.size); r.ptr must be page aligned. Spares
  // (taken back elsewhere, all of the segment's page size) come first, largest first, as long
  // as they fit in what remains to map (map_block keeps only spares that do). Then new
  // physical memory: chunks of `chunk_pages` pages in the middle, single pages at both ends
  // (1: one allocation per page, as PyTorch does). Device calls cost mostly per call, so
  // larger chunks are cheaper to create and map; single pages are cheaper to give back, since
  // a chunk can only be unmapped whole. Returns the range mapped, or an empty range when the
  // device is out of memory (nothing stays mapped; spares used are handed back to `spare`).
  Range map(Range r, std::size_t chunk_pages = 1, std::vector<SparePhysical>* spare = nullptr);
  // Unmaps every chunk lying entirely inside r (a chunk cannot be unmapped in part) and
  // releases its physical memory. With limit > 0, chunks from the front until at least `limit`
  // bytes (a chunk goes whole: up to one chunk more). Returns the contiguous range unmapped
  // (possibly empty). With `keep`, chunks are handed over instead of released, to be mapped
  // elsewhere. Unmapping does not wait for kernels still using the memory: the caller makes
  // sure the device is done with it.
  Range unmap(Range r, std::size_t limit = 0, std::vector<SparePhysical>* keep = nullptr);
  // The same chunks as unmap() would take, handed over to `keep` while they stay mapped here:
  // a physical allocation may be mapped at a second address before its first mapping goes, so
  // the pages can be mapped elsewhere at once and unmapped here once the device is done with
  // them (the caller unmaps each range in `still_mapped` then; expandable.cpp, Note [moving
  // pages]).
  Range detach(Range r, std::size_t limit, std::vector<SparePhysical>* keep,
               std::vector<Range>* still_mapped);

  // The physical allocations mapped over any part of r, in address order (CUDA IPC shares
  // them whole: the driver exports a handle only whole).
  struct MappedChunk {
    std::uintptr_t ptr;
    std::size_t size;
    PhysicalHandle handle;
  };
  std::vector<MappedChunk> chunks_in(Range r) const;

  std::uintptr_t base() const { return base_; }
  std::size_t size() const { return page_size_ * max_pages_; }
  std::size_t page_size() const { return page_size_; }
  StreamId stream() const { return stream_; }
  std::size_t mapped_bytes() const;

 private:
  struct Chunk {
    PhysicalHandle handle;
    std::size_t pages;
  };
  // The chunks wholly inside r, from the front until `limit` bytes (0: all): one contiguous run.
  std::vector<std::map<std::size_t, Chunk>::iterator> run_inside(Range r, std::size_t limit,
                                                                 std::size_t* bytes);
  std::size_t page_floor(std::uintptr_t p) const { return (p - base_) / page_size_; }
  std::size_t page_ceil(std::uintptr_t p) const {
    return (p - base_ + page_size_ - 1) / page_size_;
  }
  Range pages(std::size_t begin, std::size_t end) const {
    return Range{base_ + begin * page_size_, (end - begin) * page_size_};
  }

  Device& device_;
  StreamId stream_;
  std::size_t page_size_;
  std::size_t max_pages_;
  std::uintptr_t base_ = 0;
  std::map<std::size_t, Chunk> chunks_;  // by first page
};

}  // namespace allocwatch
