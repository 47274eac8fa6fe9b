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
      max_pages_((address_space + page_size - 1) / page_size),
      own_physical_(std::make_unique<PhysicalPages>(page_size)),
      physical_(own_physical_.get()) {
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
      if (physical_->drop_address(chunk.handle, address(first)))  // once, with its last
        device_.release_physical(chunk.handle, chunk.pages * page_size_);
    }
    device_.free_address(base_, page_size_ * max_pages_);
  } catch (...) {
  }
}

Range ExpandableSegment::map(Range r, std::size_t chunk_pages, std::vector<SparePhysical>* spare,
                             std::size_t* aliased, const SparePhysical* last,
                             std::size_t last_free) {
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
      physical_->drop_address(it->second.handle, address(f));
      device_.release_physical(it->second.handle, it->second.pages * page_size_);
      erase_chunk(it);
    }
    for (std::size_t f : reused) {
      auto it = chunks_.find(f);
      const bool alias = !physical_->drop_address(it->second.handle, address(f));
      spare->push_back(SparePhysical{it->second.handle, it->second.pages, alias});
      erase_chunk(it);
    }
    if (aliased != nullptr) *aliased = 0;
  };
  std::size_t first = begin;
  // The partly idle chunk serves the range's last pages; what comes before maps as usual.
  const std::size_t last_serves =
      last != nullptr && last->pages > 0 ? std::min(last_free, end - begin) : 0;
  const std::size_t last_at = end - last_serves;
  while (spare != nullptr && !spare->empty() && spare->back().pages <= last_at - first) {
    const SparePhysical& s = spare->back();
    put_chunk(first, Chunk{s.handle, s.pages, physical_->add_address(s.handle, s.pages, address(first))});
    if (aliased != nullptr && s.alias) *aliased += s.pages * page_size_;
    reused.push_back(first);
    first += spare->back().pages;
    spare->pop_back();
  }
  // New memory: chunks in the middle, single pages at both ends. Each end of a grown range
  // borders another block, and once that block is freed only whole free handles can be
  // given back: fine pages there leave little free memory pinned inside a chunk that is
  // partly in use (Note [page policy] in expandable.cpp, page size and chunks).
  const std::size_t chunks = chunk > 1 ? (last_at - first) / chunk : 0;
  const std::size_t singles = (last_at - first) - chunks * chunk;
  const std::size_t chunks_begin = first + (chunks > 0 ? singles / 2 : singles);
  const std::size_t chunks_end = chunks_begin + chunks * chunk;
  for (std::size_t n = 0; first < last_at; first += n) {
    n = first >= chunks_begin && first < chunks_end ? chunk : 1;
    PhysicalHandle handle = 0;
    if (!device_.create_physical(n * page_size_, &handle)) {
      give_back();
      return pages(begin, begin);
    }
    put_chunk(first, Chunk{handle, n, physical_->add_address(handle, n, address(first))});
    made.push_back(first);
  }
  std::size_t mapped_end = end;
  if (last_serves > 0) {
    put_chunk(last_at,
              Chunk{last->handle, last->pages,
                    physical_->add_address(last->handle, last->pages, address(last_at))});
    if (aliased != nullptr) *aliased += last->pages * page_size_;
    mapped_end = last_at + last->pages;
  }
  std::vector<Device::Mapping> mappings;
  for (auto it = chunks_.lower_bound(begin); it != chunks_.end() && it->first < mapped_end; ++it)
    mappings.push_back({it->second.pages * page_size_, it->second.handle});
  device_.map_range(base_ + begin * page_size_, mappings);
  return pages(begin, mapped_end);
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
    if (physical_->drop_address(it->second.handle, address(it->first))) {  // else still mapped elsewhere
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
    physical_->drop_address(it->second.handle, address(it->first));  // take_back_free_pages moves no alias
    keep->push_back(SparePhysical{it->second.handle, it->second.pages});
    still_mapped->push_back(Range{base_ + it->first * page_size_, it->second.pages * page_size_});
    erase_chunk(it);
  }
  return Range{base_ + first * page_size_, bytes};
}

void ExpandableSegment::track_aliases(PhysicalPages* shared) {
  assert(chunks_.empty() && shared->page_size() == page_size_);
  tracks_aliases_ = true;
  physical_ = shared;
  own_physical_.reset();
  page_chunks_.assign(max_pages_, PageChunk{});
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

void ExpandableSegment::use(Range r, int delta, HandOff& hand_off) {
  // By the page array, not the chunk map: a block of many one-page chunks is walked often.
  for_each_page_chunk(r, [&](const PageChunk& c, std::size_t lo, std::size_t hi) {
    Physical& p = *c.physical;
    for (std::size_t i = lo; i < hi; ++i) {
      PhysicalPages::Page& page = p.page[i];
      if (delta > 0 && page.in_use == 0) {
        if (page.handed_out && page.last_stream != stream_) {
          page.streams_changed = true;
          auto& w = hand_off.wait_for;
          auto it = std::find_if(w.begin(), w.end(),
                                 [&](const auto& x) { return x.first == page.last_stream; });
          // One wait a stream: after the latest of its pages' frees, or on all it queued
          // where a page's is unknown.
          if (it == w.end()) {
            w.emplace_back(page.last_stream, page.free_seq);
          } else if (it->second != 0) {
            it->second = page.free_seq == 0 ? 0 : std::max(it->second, page.free_seq);
          }
        }
        page.last_stream = stream_;
        page.handed_out = true;
      }
      physical_->use(p, i, address(c.first), delta);
      if (delta < 0 && page.in_use == 0) {
        // Every free takes its number; only pages that change stream are worth an event at
        // it (another stream's hand-out waits on that one, or the first recorded after it).
        page.free_seq = hand_off.free_seq;
        if (page.streams_changed && hand_off.free_seq != 0) hand_off.record = true;
      }
    }
    return true;
  });
}

bool ExpandableSegment::usable(Range r) const {
  // An allocation mapped elsewhere too may appear once in r: each seen is stamped.
  const std::uint64_t stamp = physical_->next_stamp();
  bool ok = true;
  for_each_page_chunk(r, [&](const PageChunk& c, std::size_t lo, std::size_t hi) {
    const Physical& p = *c.physical;
    if (p.addresses.size() > 1) {
      if (p.seen == stamp) return ok = false;
      p.seen = stamp;
      for (std::size_t i = lo; i < hi; ++i)
        if (!p.free_at(i, address(c.first))) return ok = false;
    }
    return true;
  });
  return ok;
}

std::uintptr_t ExpandableSegment::first_usable(Range r, std::size_t size) const {
  // One pass over the pages, restarting after any page in use elsewhere (a window that maps
  // one allocation twice restarts after the page where it was found), until no window fits.
  if (r.size < size) return 0;
  const std::uintptr_t last_start = r.ptr + r.size - size;
  std::uintptr_t start = r.ptr;
  const std::size_t end = page_ceil(r.ptr + r.size);
  for (std::size_t p = page_floor(r.ptr); p < end && start <= last_start; ++p) {
    const PageChunk& c = page_chunks_[p];
    const std::uintptr_t page_end = base_ + (p + 1) * page_size_;
    if (c.physical == nullptr || !c.physical->free_at(p - c.first, address(c.first))) {
      start = page_end;  // unmapped (nothing to hand out here) or in use elsewhere
    } else if (start + size <= page_end) {
      if (usable(Range{start, size})) return start;
      start = page_end;
    }
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
  for (const Physical* p = physical_->idle_head(); p != nullptr; p = p->idle_next) {
    if (p->pages <= max_pages && !mapped_over(*p, exclude)) idle.push_back(p);
  }
  auto where = [&](const Physical* p) {
    const PhysicalPages::Address& a = p->addresses.front();
    return a.segment->base() + a.first * page_size_;
  };
  auto before = [&](const Physical* a, const Physical* b) {
    return a->pages != b->pages ? a->pages > b->pages : where(a) < where(b);
  };
  // Handles of one size (one page each, say) are taken from the front: sort only those.
  const bool one_size = std::all_of(idle.begin(), idle.end(), [&](const Physical* p) {
    return p->pages == idle.front()->pages;
  });
  if (one_size && !idle.empty() && idle.size() > max_pages / idle.front()->pages) {
    const auto taken = static_cast<std::ptrdiff_t>(max_pages / idle.front()->pages);
    std::partial_sort(idle.begin(), idle.begin() + taken, idle.end(), before);
    idle.resize(static_cast<std::size_t>(taken));
  } else {
    std::sort(idle.begin(), idle.end(), before);
  }
  std::vector<SparePhysical> chosen;
  for (const Physical* p : idle) {
    if (p->pages > max_pages) continue;
    chosen.push_back(SparePhysical{p->handle, p->pages, true});
    max_pages -= p->pages;
  }
  return chosen;
}

bool ExpandableSegment::mapped_over(const Physical& p, Range r) const {
  for (const PhysicalPages::Address& a : p.addresses) {
    if (a.segment != this) continue;
    const std::uintptr_t b = base_ + a.first * page_size_, e = b + p.pages * page_size_;
    if (b < r.ptr + r.size && r.ptr < e) return true;
  }
  return false;
}

SparePhysical ExpandableSegment::partly_idle_chunk(Range exclude, std::size_t max_pages,
                                                  std::size_t max_total,
                                                  const std::vector<SparePhysical>& taken,
                                                  std::size_t* free_pages) const {
  SparePhysical best{0, 0, true};
  std::size_t best_serves = 0;
  *free_pages = 0;
  // Handles of one page are all idle_handles' to offer: no scan where there are only those.
  if (max_pages == 0 || physical_->chunks() == 0) return best;
  physical_->for_each([&](const Physical& p) {
    if (p.pages < 2 || p.pages > max_total || p.page[0].in_use > 0) return;
    std::size_t head = 0;
    while (head < p.pages && p.page[head].in_use == 0) ++head;
    const std::size_t serves = std::min(head, max_pages);
    if (serves < best_serves || (serves == best_serves && p.pages >= best.pages)) return;
    if (mapped_over(p, exclude)) return;
    for (const SparePhysical& t : taken)
      if (t.handle == p.handle) return;
    best = SparePhysical{p.handle, p.pages, true};
    best_serves = serves;
    *free_pages = head;
  });
  return best;
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
  if (!p.idle()) return {};
  IdlePhysical idle{it->second.handle, p.pages, {}};
  for (const PhysicalPages::Address& a : p.addresses) {
    auto* segment = const_cast<ExpandableSegment*>(a.segment);  // segments are never const
    idle.addresses.emplace_back(segment, segment->pages(a.first, a.first + p.pages));
  }
  return idle;
}

void ExpandableSegment::detach_physical(const IdlePhysical& p, std::vector<SparePhysical>* keep) {
  PhysicalPages* physical = p.addresses.front().first->physical_;
  for (const PhysicalPages::Address& a : physical->forget(p.handle)) {
    auto* segment = const_cast<ExpandableSegment*>(a.segment);
    segment->erase_chunk(segment->chunks_.find(a.first));
  }
  keep->push_back(SparePhysical{p.handle, p.pages});
}

void ExpandableSegment::count_in_use(const std::vector<Range>& in_use,
                                     PhysicalPages::InUseCounts* counts) const {
  for (const Range& r : in_use) {
    const std::size_t begin = page_floor(r.ptr), end = page_ceil(r.ptr + r.size);
    for (const MappedChunk& c : chunks_in(r)) {
      const std::size_t first = page_floor(c.ptr);
      const std::size_t from = std::max(begin, first);
      const std::size_t to = std::min(end, first + c.size / page_size_);
      for (std::size_t page = from; page < to; ++page) (*counts)[{this, page}] += 1;
    }
  }
}

}  // namespace allocwatch
