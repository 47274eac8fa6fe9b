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
    for (const auto& [first, chunk] : chunks_)
      device_.unmap(base_ + first * page_size_, chunk.pages * page_size_);
    for (const auto& [handle, physical] : physical_)  // once, however many addresses
      device_.release_physical(handle, physical.pages * page_size_);
    device_.free_address(base_, page_size_ * max_pages_);
  } catch (...) {
  }
}

Range ExpandableSegment::map(Range r, std::size_t chunk_pages, std::vector<SparePhysical>* spare,
                             std::size_t* aliased) {
  if (aliased != nullptr) *aliased = 0;
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
      auto it = chunks_.find(f);
      drop_address(it->second.handle, f);
      device_.release_physical(it->second.handle, it->second.pages * page_size_);
      erase_chunk(it);
    }
    for (std::size_t f : reused) {
      auto it = chunks_.find(f);
      const bool alias = !drop_address(it->second.handle, f);
      spare->push_back(SparePhysical{it->second.handle, it->second.pages, alias});
      erase_chunk(it);
    }
    if (aliased != nullptr) *aliased = 0;
  };
  std::size_t first = begin;
  while (spare != nullptr && !spare->empty() && spare->back().pages <= end - first) {
    const SparePhysical& s = spare->back();
    put_chunk(first, Chunk{s.handle, s.pages, add_address(s.handle, s.pages, first)});
    if (aliased != nullptr && s.alias) *aliased += s.pages * page_size_;
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
    put_chunk(first, Chunk{handle, n, add_address(handle, n, first)});
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

Range ExpandableSegment::unmap(Range r, std::size_t limit, std::vector<SparePhysical>* keep,
                               std::size_t* released) {
  std::size_t bytes = 0;
  if (released != nullptr) *released = 0;
  auto run = run_inside(r, limit, &bytes);
  if (run.empty()) return Range{r.ptr, 0};
  const std::size_t first = run.front()->first;
  for (auto it : run) {
    const std::size_t n = it->second.pages * page_size_;
    device_.unmap(base_ + it->first * page_size_, n);
    if (drop_address(it->second.handle, it->first)) {  // else still mapped elsewhere
      if (released != nullptr) *released += n;
      if (keep != nullptr) {
        keep->push_back(SparePhysical{it->second.handle, it->second.pages});
      } else {
        device_.release_physical(it->second.handle, n);
      }
    }
    erase_chunk(it);
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
    drop_address(it->second.handle, it->first);  // take_back_free_pages moves no alias
    keep->push_back(SparePhysical{it->second.handle, it->second.pages});
    still_mapped->push_back(Range{base_ + it->first * page_size_, it->second.pages * page_size_});
    erase_chunk(it);
  }
  return Range{base_ + first * page_size_, bytes};
}

void ExpandableSegment::track_aliases() {
  tracks_aliases_ = true;
  page_chunks_.assign(max_pages_, PageChunk{});
  for (const auto& [first, chunk] : chunks_)
    for (std::size_t p = first; p < first + chunk.pages; ++p)
      page_chunks_[p] = PageChunk{chunk.physical, static_cast<std::uint32_t>(first),
                                  static_cast<std::uint32_t>(chunk.pages)};
}

void ExpandableSegment::put_chunk(std::size_t first, Chunk c) {
  chunks_[first] = c;
  if (!tracks_aliases_) return;
  for (std::size_t p = first; p < first + c.pages; ++p)
    page_chunks_[p] = PageChunk{c.physical, static_cast<std::uint32_t>(first),
                                static_cast<std::uint32_t>(c.pages)};
}

void ExpandableSegment::erase_chunk(std::map<std::size_t, Chunk>::iterator it) {
  if (tracks_aliases_)
    for (std::size_t p = it->first; p < it->first + it->second.pages; ++p) page_chunks_[p] = {};
  chunks_.erase(it);
}

std::vector<ExpandableSegment::MappedChunk> ExpandableSegment::chunks_in(Range r) const {
  std::vector<MappedChunk> out;
  for_each_chunk(r, [&](std::size_t first, const Chunk& c) {
    out.push_back(MappedChunk{base_ + first * page_size_, c.pages * page_size_, c.handle});
    return true;
  });
  return out;
}

std::size_t ExpandableSegment::mapped_bytes() const {
  std::size_t n = 0;
  for (const auto& [first, chunk] : chunks_) n += chunk.pages * page_size_;
  return n;
}

std::size_t ExpandableSegment::physical_bytes() const {
  std::size_t n = 0;
  for (const auto& [handle, physical] : physical_) n += physical.pages * page_size_;
  return n;
}

ExpandableSegment::Physical* ExpandableSegment::add_address(PhysicalHandle h, std::size_t pages,
                                                            std::size_t first) {
  auto [it, created] = physical_.try_emplace(h, Physical{h, pages, {}});
  it->second.addresses.push_back(Address{first});
  if (created) {
    idle_bytes_ += pages * page_size_;
    link_idle(&it->second);
  }
  return &it->second;
}

bool ExpandableSegment::drop_address(PhysicalHandle h, std::size_t first) {
  auto it = physical_.find(h);
  if (it == physical_.end()) return true;
  auto& addresses = it->second.addresses;
  addresses.erase(std::remove_if(addresses.begin(), addresses.end(),
                                 [&](const Address& a) { return a.first == first; }),
                  addresses.end());
  if (!addresses.empty()) return false;
  // Only free addresses are unmapped: an allocation without addresses is idle.
  idle_bytes_ -= it->second.pages * page_size_;
  unlink_idle(&it->second);
  physical_.erase(it);
  return true;
}

void ExpandableSegment::use(Range r, int delta) {
  for_each_chunk(r, [&](std::size_t first, const Chunk& c) {
    Physical& p = *c.physical;
    const bool was_idle = p.in_use == 0;
    p.in_use += delta;
    p.in_use_at = p.in_use > 0 ? first : kNoAddress;
    if (was_idle && p.in_use > 0) {
      idle_bytes_ -= p.pages * page_size_;
      unlink_idle(&p);
    }
    if (!was_idle && p.in_use == 0) {
      idle_bytes_ += p.pages * page_size_;
      link_idle(&p);
    }
    return true;
  });
}

bool ExpandableSegment::usable(Range r) const {
  // An allocation mapped elsewhere too may appear once in r: each seen is stamped.
  const std::uint64_t stamp = ++usable_stamp_;
  const std::size_t end = page_ceil(r.ptr + r.size);
  for (std::size_t p = page_floor(r.ptr); p < end;) {
    const PageChunk& c = page_chunks_[p];
    if (c.physical == nullptr) {
      ++p;
      continue;
    }
    if (c.physical->addresses.size() > 1) {
      if (!c.physical->free_at(c.first) || c.physical->seen == stamp) return false;
      c.physical->seen = stamp;
    }
    p = c.first + c.pages;
  }
  return true;
}

std::uintptr_t ExpandableSegment::first_usable(Range r, std::size_t size) const {
  // One pass over the pages, restarting after any chunk in use elsewhere (a window that maps
  // one allocation twice restarts after the chunk where it was found), until no window fits.
  if (r.size < size) return 0;
  const std::uintptr_t last_start = r.ptr + r.size - size;
  std::uintptr_t start = r.ptr;
  const std::size_t end = page_ceil(r.ptr + r.size);
  for (std::size_t p = page_floor(r.ptr); p < end && start <= last_start;) {
    const PageChunk& c = page_chunks_[p];
    if (c.physical == nullptr) {  // not in a free block's range: nothing to hand out here
      start = base_ + (++p) * page_size_;
      continue;
    }
    const std::uintptr_t chunk_end = base_ + (c.first + c.pages) * page_size_;
    if (!c.physical->free_at(c.first)) {
      start = chunk_end;
    } else if (start + size <= chunk_end) {
      if (usable(Range{start, size})) return start;
      start = chunk_end;
    }
    p = c.first + c.pages;
  }
  return 0;
}

bool ExpandableSegment::has_aliases(Range r) const {
  bool any = false;
  for_each_chunk(r, [&](std::size_t, const Chunk& c) {
    any = c.physical->addresses.size() > 1;
    return !any;
  });
  return any;
}

std::vector<SparePhysical> ExpandableSegment::idle_handles(Range exclude,
                                                           std::size_t max_pages) const {
  // Largest first, then by the address each was first mapped at.
  std::vector<const Physical*> idle;
  for (const Physical* p = idle_head_; p != nullptr; p = p->idle_next) {
    if (p->pages > max_pages) continue;
    bool overlaps = false;
    for (const Address& a : p->addresses) {
      const std::uintptr_t b = base_ + a.first * page_size_, e = b + p->pages * page_size_;
      if (b < exclude.ptr + exclude.size && exclude.ptr < e) overlaps = true;
    }
    if (!overlaps) idle.push_back(p);
  }
  std::sort(idle.begin(), idle.end(), [](const Physical* a, const Physical* b) {
    return a->pages != b->pages ? a->pages > b->pages
                                : a->addresses.front().first < b->addresses.front().first;
  });
  std::vector<SparePhysical> chosen;
  for (const Physical* p : idle) {
    if (p->pages > max_pages) continue;
    chosen.push_back(SparePhysical{p->handle, p->pages, true});
    max_pages -= p->pages;
  }
  return chosen;
}

void ExpandableSegment::link_idle(Physical* p) {
  p->idle_prev = nullptr;
  p->idle_next = idle_head_;
  if (idle_head_ != nullptr) idle_head_->idle_prev = p;
  idle_head_ = p;
}

void ExpandableSegment::unlink_idle(Physical* p) {
  (p->idle_prev != nullptr ? p->idle_prev->idle_next : idle_head_) = p->idle_next;
  if (p->idle_next != nullptr) p->idle_next->idle_prev = p->idle_prev;
  p->idle_prev = p->idle_next = nullptr;
}

ExpandableSegment::IdlePhysical ExpandableSegment::idle_chunk(Range r, bool front) const {
  const std::size_t lo = page_ceil(r.ptr), hi = page_floor(r.ptr + r.size);
  if (lo >= hi) return {};
  auto it = chunks_.end();
  if (front) {
    it = chunks_.find(lo);
  } else {
    it = chunks_.lower_bound(hi);
    if (it != chunks_.begin()) --it;
    if (it != chunks_.end() && (it->first < lo || it->first + it->second.pages != hi))
      it = chunks_.end();
  }
  if (it == chunks_.end() || it->first + it->second.pages > hi) return {};
  const Physical& p = *it->second.physical;
  if (p.in_use > 0) return {};
  IdlePhysical idle{it->second.handle, p.pages, {}};
  for (const Address& a : p.addresses) idle.addresses.push_back(pages(a.first, a.first + p.pages));
  return idle;
}

void ExpandableSegment::detach_physical(PhysicalHandle handle, std::vector<SparePhysical>* keep) {
  auto it = physical_.find(handle);
  assert(it != physical_.end() && it->second.in_use == 0);
  for (const Address& a : it->second.addresses) erase_chunk(chunks_.find(a.first));
  idle_bytes_ -= it->second.pages * page_size_;
  unlink_idle(&it->second);
  keep->push_back(SparePhysical{handle, it->second.pages});
  physical_.erase(it);
}

std::string ExpandableSegment::check_aliases(const std::vector<Range>& in_use) const {
  std::map<std::size_t, int> counted;  // first page of an address -> blocks in use over it
  for (const Range& r : in_use)
    for (const MappedChunk& c : chunks_in(r)) counted[page_floor(c.ptr)] += 1;
  std::size_t idle = 0;
  for (const auto& [handle, p] : physical_) {
    int addresses_in_use = 0, total = 0;
    std::size_t at = kNoAddress;
    for (const Address& a : p.addresses) {
      auto it = counted.find(a.first);
      const int n = it == counted.end() ? 0 : it->second;
      if ((a.first == p.in_use_at ? p.in_use : 0) != n)
        return "an address's count of blocks in use is wrong";
      if (n > 0) ++addresses_in_use, at = a.first;
      total += n;
    }
    if (addresses_in_use > 1) return "a physical allocation is in use through two addresses";
    if (p.in_use != total || p.in_use_at != at)
      return "a physical allocation's count of blocks in use is wrong";
    if (addresses_in_use == 0) idle += p.pages * page_size_;
  }
  if (idle != idle_bytes_) return "the segment's idle bytes disagree with a recount";
  std::size_t listed = 0;
  for (const Physical* p = idle_head_; p != nullptr; p = p->idle_next) {
    if (p->in_use > 0) return "a physical allocation in use is listed as idle";
    listed += p->pages * page_size_;
  }
  if (listed != idle_bytes_) return "the list of idle physical allocations is incomplete";
  return "";
}

}  // namespace allocwatch
