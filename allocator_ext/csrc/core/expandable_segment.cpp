#include "expandable_segment.h"

#include <cassert>

namespace allocwatch {

ExpandableSegment::ExpandableSegment(Device& device, StreamId stream, std::size_t address_space,
                                     std::size_t page_size)
    : device_(device),
      stream_(stream),
      page_size_(page_size),
      max_pages_((address_space + page_size - 1) / page_size) {
  base_ = device_.reserve_address(page_size_ * max_pages_, page_size_);
}

ExpandableSegment::~ExpandableSegment() {
  // The allocator releases a segment only once every page is unmapped; this is a safety net
  // for teardown, where the device may already be gone, so errors are swallowed.
  try {
    for (std::size_t i = 0; i < handles_.size(); ++i) {
      if (!handles_[i]) continue;
      device_.unmap(base_ + i * page_size_, page_size_);
      device_.release_physical(*handles_[i], page_size_);
    }
    device_.free_address(base_, page_size_ * max_pages_);
  } catch (...) {
  }
}

Range ExpandableSegment::map(Range r, std::vector<PhysicalHandle>* spare) {
  std::size_t begin = page_floor(r.ptr);
  std::size_t end = page_ceil(r.ptr + r.size);
  assert(base_ + begin * page_size_ == r.ptr);
  if (begin == end) return pages(begin, end);
  if (handles_.size() < end) handles_.resize(end);
  for (std::size_t i = begin; i < end; ++i) {
    assert(!handles_[i]);
    PhysicalHandle handle = 0;
    if (spare != nullptr && !spare->empty()) {
      handle = spare->back();
      spare->pop_back();
    } else if (!device_.create_physical(page_size_, &handle)) {
      // Out of memory: give back what this call created, so nothing half-mapped remains.
      for (std::size_t j = begin; j < i; ++j) {
        device_.release_physical(*handles_[j], page_size_);
        handles_[j].reset();
      }
      trim();
      return pages(begin, begin);
    }
    handles_[i] = handle;
  }
  for (std::size_t i = begin; i < end; ++i) device_.map(base_ + i * page_size_, page_size_, *handles_[i]);
  return pages(begin, end);
}

Range ExpandableSegment::unmap(Range r, std::vector<PhysicalHandle>* keep) {
  std::size_t begin = page_ceil(r.ptr);
  std::size_t end = page_floor(r.ptr + r.size);
  if (begin >= end) return Range{r.ptr, 0};
  // Unmapping does not wait for kernels still using the pages: the stream must be idle.
  device_.synchronize_stream(stream_);
  for (std::size_t i = begin; i < end; ++i) {
    PhysicalHandle h = *handles_[i];
    handles_[i].reset();
    device_.unmap(base_ + i * page_size_, page_size_);
    if (keep != nullptr) {
      keep->push_back(h);
    } else {
      device_.release_physical(h, page_size_);
    }
  }
  trim();
  return pages(begin, end);
}

std::size_t ExpandableSegment::mapped_bytes() const {
  std::size_t n = 0;
  for (const auto& h : handles_) n += h ? page_size_ : 0;
  return n;
}

void ExpandableSegment::trim() {
  while (!handles_.empty() && !handles_.back()) handles_.pop_back();
}

}  // namespace allocwatch
