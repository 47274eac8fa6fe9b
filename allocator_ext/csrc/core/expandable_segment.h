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
#include <memory>
#include <vector>

#include "device.h"
#include "physical_pages.h"

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
  bool alias = false;  // stays mapped where it is too: mapped at one more address, not moved
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
  // `aliased`: the bytes of r that spares marked `alias` serve (no new physical memory).
  // `last`: a physical allocation mapped elsewhere whose first `last_free` pages are in use
  // nowhere (partly_idle_chunk): mapped at the end of r, it serves r's last pages (at most
  // last_free), and its other pages lie past r, mapped but usable only once free elsewhere
  // too; the range returned then ends with it.
  Range map(Range r, std::size_t chunk_pages = 1, std::vector<SparePhysical>* spare = nullptr,
            std::size_t* aliased = nullptr, const SparePhysical* last = nullptr,
            std::size_t last_free = 0);
  // Unmaps every chunk lying entirely inside r (a chunk cannot be unmapped in part) and
  // releases its physical memory. With limit > 0, chunks from the front until at least `limit`
  // bytes (a chunk goes whole: up to one chunk more). Returns the contiguous range unmapped
  // (possibly empty). With `keep`, chunks are handed over instead of released, to be mapped
  // elsewhere. Unmapping does not wait for kernels still using the memory: the caller makes
  // sure the device is done with it. A chunk whose physical memory is mapped at another
  // address too loses only this one; `released` counts the physical bytes that went.
  Range unmap(Range r, std::size_t limit = 0, std::vector<SparePhysical>* keep = nullptr,
              std::size_t* released = nullptr);
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
  std::size_t mapped_bytes() const;  // address space mapped
  // Its physical allocations: its own, or those of every segment it shares them with.
  const PhysicalPages& physical() const { return *physical_; }

  // --- aliased pages (alias_pages; expandable.cpp, Note [aliased pages]) ---
  // From now on the segment counts the blocks in use over each address of its physical
  // allocations, in `shared` (with other segments of the same page size), and a physical
  // allocation may be mapped at several addresses, of this segment or theirs. Only before
  // anything is mapped.
  void track_aliases(PhysicalPages* shared);
  bool tracks_aliases() const { return tracks_aliases_; }
  // What a hand-out or a free over aliased pages needs of the device (Note [aliased pages]).
  struct HandOff {
    // Handed out: each other stream whose work on a page under the block must come first,
    // with the number the page's free there took (its free_seq: an event of that number or
    // later orders after it; 0: none known, so whatever that stream has queued).
    std::vector<std::pair<StreamId, std::uint64_t>> wait_for;
    // Freed: the number this free takes; the caller records an event of it on the block's
    // stream if `record` comes back true (a page that changes stream went idle).
    std::uint64_t free_seq = 0;
    bool record = false;
  };
  // A block over r was handed out (+1) or freed (-1).
  void use(Range r, int delta, HandOff& hand_off);
  // r may be handed out: no physical allocation under it is in use through another address,
  // and none is mapped twice inside it.
  bool usable(Range r) const;
  // The lowest address in r, r.ptr or a chunk's start, from which `size` bytes are usable; 0:
  // none.
  std::uintptr_t first_usable(Range r, std::size_t size) const;
  // Some physical allocation mapped over r is mapped at another address too.
  bool has_aliases(Range r) const;
  // Physical allocations in use through none of their addresses, none mapped over `exclude`
  // here, at most `max_pages` pages in all, largest first (then in address order): spares that
  // map them at one more address.
  std::vector<SparePhysical> idle_handles(Range exclude, std::size_t max_pages) const;
  // A physical allocation of several pages whose first pages are in use through none of its
  // addresses, none mapped over `exclude` here and none among `taken`: the one whose free
  // front serves the most of `max_pages` (then the smallest), mapped at the end of a growth
  // with its other pages past it (Note [aliased pages], pages of a chunk); pages 0: none.
  // `*free_pages`: its pages in use nowhere from the front.
  SparePhysical partly_idle_chunk(Range exclude, std::size_t max_pages, std::size_t max_total,
                                  const std::vector<SparePhysical>& taken,
                                  std::size_t* free_pages) const;
  // Physical bytes in use through none of their addresses.
  std::size_t idle_bytes() const { return physical_->idle_bytes(); }
  // A physical allocation in use through none of its addresses, with every range it is mapped
  // at and the segment of each: memory that can leave whole for another pool.
  struct IdlePhysical {
    PhysicalHandle handle = 0;
    std::size_t pages = 0;
    std::vector<std::pair<ExpandableSegment*, Range>> addresses;
  };
  // The one whose chunk is the first (front) or last chunk wholly inside r, if idle; pages 0:
  // none.
  IdlePhysical idle_chunk(Range r, bool front) const;
  // Forgets every address of an idle physical allocation, in whichever segment, and hands it
  // to `keep`, while the device still has it mapped at each: the caller unmaps them once the
  // device is done with them (Note [moving pages]).
  static void detach_physical(const IdlePhysical& p, std::vector<SparePhysical>* keep);
  // Adds, for each address of this segment, the blocks in use over it (their ranges) to
  // `counts`: PhysicalPages::check's input.
  void count_in_use(const std::vector<Range>& in_use, PhysicalPages::InUseCounts* counts) const;

 private:
  using Physical = PhysicalPages::Physical;
  struct Chunk {
    PhysicalHandle handle;
    std::size_t pages;
    Physical* physical;  // its entry in physical_
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
  std::map<std::size_t, Chunk> chunks_;  // by first page: each address mapped
  // With aliases tracked, each page's chunk too, by page: first_usable() scans long free
  // blocks page by page, which an array does several times faster than the map.
  struct PageChunk {
    Physical* physical = nullptr;  // none: unmapped
    std::uint32_t first = 0;       // the chunk's first page
    std::uint32_t pages = 0;
  };
  std::vector<PageChunk> page_chunks_;
  void put_chunk(std::size_t first, Chunk c);
  void erase_chunk(std::map<std::size_t, Chunk>::iterator it);
  std::unique_ptr<PhysicalPages> own_physical_;
  PhysicalPages* physical_;  // own_physical_, or one shared with other segments
  PhysicalPages::Address address(std::size_t first) const { return {this, first}; }
  // p is mapped here at an address that overlaps r.
  bool mapped_over(const Physical& p, Range r) const;
  // f(page chunk, lo, hi) for each chunk mapped over any part of r, with [lo, hi) the pages of
  // the chunk (offsets in it) that r covers, by the page array (aliases tracked), while f
  // returns true.
  template <class F>
  void for_each_page_chunk(Range r, F&& f) const {
    const std::size_t begin = page_floor(r.ptr), end = page_ceil(r.ptr + r.size);
    for (std::size_t page = begin; page < end;) {
      const PageChunk& c = page_chunks_[page];
      if (c.physical == nullptr) {  // unmapped
        ++page;
        continue;
      }
      const std::size_t chunk_end = c.first + c.pages;
      if (!f(c, std::max<std::size_t>(begin, c.first) - c.first,
             std::min<std::size_t>(end, chunk_end) - c.first))
        return;
      page = chunk_end;
    }
  }
  // f(first page, chunk) for each chunk mapped over any part of r, in address order, while f
  // returns true.
  template <class F>
  void for_each_chunk(Range r, F&& f) const {
    if (r.size == 0) return;
    const std::size_t begin = page_floor(r.ptr), end = page_ceil(r.ptr + r.size);
    auto it = chunks_.upper_bound(begin);
    if (it != chunks_.begin()) --it;  // the chunk that may start before r
    for (; it != chunks_.end() && it->first < end; ++it)
      if (it->first + it->second.pages > begin && !f(it->first, it->second)) return;
  }
  bool tracks_aliases_ = false;
};

}  // namespace allocwatch
