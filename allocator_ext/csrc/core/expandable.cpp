// Expandable segments inside the allocator: finding room, mapping pages on demand, unmapping
// them on reclaim, and (allocwatch's addition) moving fully free pages to where growth is
// needed instead of asking the device for more.
//
// Note [page policy]
// ~~~~~~~~~~~~~~~~~~
// allocwatch's own rules for expandable segments, on with its defaults (reuse_free_pages,
// settle_page_moves, 2 MiB large pages in chunks); PyTorch maps new pages for every growth and
// unmaps only in empty_cache. Each rule was chosen by replaying the recorded traces
// (bench/replay/fragmentation.py for reserved memory and device calls, and
// bench/replay/steady_state.py for the calls repeated passes keep making); the figures, and
// the variants that lost, are in docs/benchmarks.md ("Each rule switched off"). Code elsewhere
// cites this note rather than arguing the rules again.
//
// Take-back. Growing a segment while wholly free pages sit elsewhere raises reserved memory for
// nothing, so before a segment grows such pages are unmapped and their physical memory mapped
// where the growth is needed. The growing pool's own free pages come first (same page size: the
// handles move as they are, no release and create), then its sibling pool's: the small pool
// takes the large pool's (a decoder's small KV-cache tensors then grow into memory the large
// pool no longer uses), the large pool the small pool's (moved as they are where both page
// sizes are 2 MiB, otherwise released so that their memory goes into the page created
// instead). Largest free blocks first: fewest calls per byte. A handle taken back is mapped
// again whole where it fits, never released and re-created.
//
// High-water mark. A moved page costs device calls (an event, a map, later an unmap) in every
// step that moves it. Pages are therefore taken
// back only where growing would raise reserved memory above its high-water mark (the most
// reserved since the start or the last explicit reclaim), or where there is no room left (the
// memory fraction, or a device out of memory). Below the mark a new page raises no peak, so a
// training loop whose shapes vary settles with its peak's pages mapped and stops moving them.
// An explicit reclaim (empty_cache, garbage_collect) lowers the mark to what it leaves: the
// caller asked for less memory from then on.
//
// Small-pool reserve. The large pool leaves the small pool's last kSmallPagesKept free pages
// in place. Without a reserve the small pool at once re-creates what it gave, and that churn
// cost out-of-memory errors under a cap and page moves in every repeated pass; one page was
// too few, more than two kept more than needed. The reserve counts free bytes, partly used
// pages' included (they serve small requests too); pages go whole, so a take-back can end up
// to one page below it. Counting whole pages only moved fewer pages but fragmented more.
//
// Page size and chunks. A partly used page strands up to a page: 2 MiB large pages (PyTorch's:
// 20 MiB) strand a tenth as much. Created one by one they cost too many device calls, so
// large-pool growth creates chunks (expandable_chunk_mb) in the middle of the grown range and
// single pages at both of its ends, where it borders other blocks whose free space must stay
// givable once they are freed (ExpandableSegment::map). The chunk size is a measured sweet
// spot, not a plateau. A chunk still goes back whole or not at all, so a chunk partly in use
// pins its free pages; under a cap those pinned pages are where a long run's later
// repetitions ran out of memory (a convnet at 1.03 x its peak request: four errors a pass from
// pass 12 on, its free memory in 41 pieces of at most 7 MiB). So under a memory fraction
// below the whole device, large-pool growth creates single pages from the start: the chunks
// created on the way up are the ones that pin pages once the fraction is near (growing in
// chunks until 95 % of it still ran the trainer's and KV-cache's recordings out of memory at
// 1.03 x; single pages throughout, none). The price is a create call a page (about 10 us on
// an H200: a third of a second for 70 GiB grown), and a call a page for each move. Without a
// fraction the ceiling is known only once the device refuses growth: then growth that would
// bring reserved memory within 5 % of it (reserved memory plus what the device had left)
// creates single pages. A refusal far above what is reserved (cuDNN's benchmark mode probing
// for a workspace larger than the device) leaves growth chunked; a new memory fraction, or
// growth past that ceiling (another process freed memory), forgets it.
//
// Alignment (align_to_pages, off by default). Growth for a block that starts inside a page
// (after the free end of a block in use) maps pages from that page on, and the block spans it
// too: once its neighbours are freed and their whole pages taken back, it holds one page more
// than its size needs (a decoder's KV-cache blocks of just under 32 MiB: 17 pages each). With
// the setting such a block starts at the first page growth mapped wherever that needs no more
// pages, and the bytes before it stay free in the neighbour's page. Only growth in single pages
// aligns (under a memory fraction below the whole device, near the device's ceiling, or with
// expandable_chunk_mb:2): aligning chunked growth too took as many traces out of their bar as
// into it. And only growth: a cached block's pages exist already, shared with its neighbours,
// and a gap there serves nothing while both live (aligning those too put MoE's experts, packed
// back to back, at 1.025 x). Replayed with single pages throughout it holds 20 of 37 traces
// within their bar where single pages alone hold 15 (convnet 1.012 -> 1.009, decode 1.021 ->
// 1.014, the record_stream pipeline 1.355 -> 1.225), but calls cost over 2 % on 11 traces, as
// single pages' do. On the GPU single pages with alignment reserved less than the defaults on
// the trainer, graph and KV-cache patterns, but the trainer's step ran slower, creating more
// pages; beside the defaults, alignment under a cap moved pages in every step of the stream
// pipeline (1.9 x its step). So it stays off, tried by `allocwatch tune` (docs/benchmarks.md,
// "Each rule switched off").
//
// Memory fraction. With reuse_free_pages the fraction is checked in map_block, after the
// take-back, against what growth really adds. PyTorch checks reserved memory plus the whole
// request before, and over it frees every cached block and waits for every stream where moving
// a few free pages would have done; the native preset keeps PyTorch's check.
//
// Streams. A free block's pages go to the growing segment's stream without the host waiting
// for anything (Note [moving pages]).
//
// Captures. Nothing is moved while a CUDA graph is captured anywhere in the process: a move
// records events, which a capture forbids (PyTorch releases nothing during capture either).
// Growth then creates pages.
//
// Long runs. A workload that repeats sits with reserved memory at its mark, so every growth
// it still needs takes pages back. A take-back comes up short where the free memory left lies
// inside partly used chunks or pages; the pages created for the shortfall raise the mark for
// good. And each take-back unmaps free blocks inside mapped ranges, which splits them: the
// next repetition finds its free memory in other, smaller pieces, needs to grow again, and
// takes back again. Left alone, the mark ratchets up by the shortfalls while the mapped ranges
// multiply (the example trace in a loop: about 10 ranges after the first pass, about 100
// after 200 passes; +3 % of reserved memory), the moves never stop (a fixed-shape convnet:
// device calls costing up to 9 % of a pass, every pass), and under a tight cap a later
// repetition runs out of memory where the first fitted. Hence the next rule.
//
// Repeated moves (settle_page_moves, on by default). A take-back is a cycle once it recurs:
// the same request on the same stream with the same bytes allocated is the same moment of a
// repeated step, and the pages it moves will have moved back by then, or the repetition would
// have found them. So the second time it creates its pages instead, once; the layout keeps
// them and the step stops moving pages. Such a growth grows where the fewest of its bytes are
// unmapped, not at the lowest address where it fits: the take-backs left holes all over the
// segment, and the lowest one that fits may need far more new pages than a hole beside free
// memory; pages created there also change where the next repetition's earlier requests land,
// which then need growth of their own (ckpt settled a pass later, 8.8 % above pass 2, before
// this placement; settles at pass 2 with it). Past the memory fraction pages move regardless
// (they are the only room), and an explicit reclaim forgets the growths seen, as it lowers the
// mark. The cost: settling holds, from the first recurrence on, the memory that the moves of
// the following repetitions would have saved and the creep would have spent later anyway. A
// workload whose steps repeat inside one recording pays it in its first pass: multistream's
// single replay reserves 1.0565 x its peak request instead of 1.0278 (and 1.054 x after 200
// passes of moving). No rule keyed on the recurrence tells that first pass from a second, and
// the moves cannot stay: docs/benchmarks.md, "Repeated passes", has the figures and the
// variants that lost.
//
// Note [aliased pages]
// ~~~~~~~~~~~~~~~~~~~~
// alias_pages, off by default. A repeated step needs the same physical memory at different
// addresses at different moments of the step: moving it costs device calls every step, and
// creating more (settling) costs memory. With aliased pages a physical allocation keeps every
// address it was mapped at, and is used through one of them at a time. The general large
// pool's segments, one per stream, share their physical allocations (PhysicalPages):
// - growth first maps, at the growing address, physical memory of any of them that no block
//   in use covers through any of its addresses: one map call, no new memory, no unmap;
// - a free block is handed out only where none of its physical memory is in use through
//   another address, and none is mapped twice inside it (ExpandableSegment::usable); a free
//   block whose front is in use elsewhere serves from the lowest address inside it where the
//   request is usable;
// - a block over memory last handed out on another stream makes its stream wait on the device
//   (cudaStreamWaitEvent) for that stream's work up to the memory's free, as cudaMallocAsync
//   orders cross-stream reuse. Each free takes a number, and memory that has changed stream
//   once gets an event at each free (one a free); a hand-out waits on the first event recorded
//   on the other stream at or after the free, only where it has not completed (one query), and
//   records one only where none has been recorded since: an event recorded at the hand-out
//   covers all that stream has queued by then (in FSDP2, the next collectives too). Frees query
//   nothing: a stream's events complete in order, and its list is trimmed every 64 by
//   bisection (host time, in a stream pipeline, is what these calls cost). The host never
//   waits, and no page moves between streams;
// - memory of other segments moves here as usual; the shared memory leaves for another pool
//   (a take-back of the small pool, say) only whole, with every address, and only where it is
//   in use through none: each address is carved from an end of its free block and unmapped
//   once the events of the move complete (move_idle_physical, Note [moving pages]);
// - an unmap releases physical memory with its last address (empty_cache, garbage
//   collection), and reserved memory counts physical memory once;
// - use is counted page by page, so a page of a chunk is usable at one address while another
//   page of it is in use at another. The driver maps a handle only whole, so a chunk partly in
//   use serves a growth only where its other pages keep out of the request's way: after the
//   handles in use nowhere, growth maps the chunk whose free front covers the most of what is
//   left at the end of the range, its other pages past the request (usable there once free
//   everywhere).
// Once each physical allocation has the addresses the step's requests land on, the step makes
// no device call and holds what it uses at its peak, in whole handles. Small handles
// (expandable_chunk_mb:2 or 4) are where it pays, since a chunk's pages in use elsewhere break
// up the address range of the rest; measured by replay (docs/benchmarks.md, "Aliased pages").
// Its cost is address space, mapped again for each address, and it has no bound: nothing
// unmaps an address while its memory is in use through another, so a step whose requests
// land where no address range has every page idle (fresh shapes; FSDP2's 1 GiB buffers under a
// cap) maps idle pages at new addresses pass after pass, reserved memory flat and the
// driver's mappings growing (replay, 20 passes: the address space beyond reserved grows on 27
// of 44 runs, a trainer's to 35 x its memory). A snapshot lists addresses, so a page mapped at
// several shows at each.
// Private pools and the small pool keep one address per page.
//
// alias_pages_under_limit, off by default, turns the same on for the general large pool's
// segments made while a memory fraction below the whole device (or a memory limit) is set and
// none of them exists (the first decides; all released, the next decides again). Under a limit
// growth maps single pages anyway (Note [page policy], page size and chunks), so aliasing costs
// no extra creates there; and a moved page costs an unmap each time it moves (about 20 us, per
// mapping: one call over several mappings costs as many), which a pipeline passing memory
// between two streams pays on every pass. It stays off: on the GPU the pipeline held 1.05 x its
// peak request but stepped 1.18-1.32 x slower where PyTorch's allocators kept up
// (docs/benchmarks.md, "Aliased pages").
//
// Note [moving pages]
// ~~~~~~~~~~~~~~~~~~~
// A take-back never waits on the host. The training loop's CPU runs ahead of the GPU, and a
// wait (cudaStreamSynchronize, cudaDeviceSynchronize) drains that run-ahead: in a pipeline that
// moves pages every step it cost a fifth of the step time. So a move is ordered on the device:
// - the donor's pages stay mapped where they were while their physical memory is mapped at
//   once where the growth needs it (the driver maps one allocation at several addresses);
// - where the donor block belonged to another stream, the receiving stream waits on the device
//   for an event recorded on the donor's stream (cudaStreamWaitEvent), as cudaMallocAsync
//   orders cross-stream reuse: the kernels that will use the pages queue behind those that
//   used them;
// - the old mapping is unmapped once events recorded at the move on every stream that
//   allocates here (the segments' streams) have completed, found by polling them on later
//   allocations as pending frees are; until then its address space is neither free nor
//   reusable. An unmap must wait for the device (unlike cudaFree, cuMemUnmap does not), and a
//   kernel of another stream may still read the old address where its tensor was used there
//   without record_stream (PyTorch's allocator tolerates that: it never unmaps a block it
//   caches), hence more than the donor's stream. Uses that record_stream named were over before
//   the block was free. Such an unrecorded read races with the new owner's writes exactly as
//   it would race with PyTorch's reuse of the block on its own stream;
// - with unmap_off_thread (off by default: on an H100 the pipeline's page-moving steps were
//   no faster for it; docs/benchmarks.md), the unmap call itself
//   (20-40 us a mapping on an H100, most of what a move costs the host) is made by the
//   allocator's own thread where the device allows it (core/unmapper.h): the allocation that
//   finds the events complete hands the ranges over and goes on, and a later one finds them
//   unmapped. Releasing the whole cache (an explicit reclaim, a last retry), which waits on
//   the host anyway, waits for that thread too (num_host_waits.unmap_thread).
//   A replay's device has that thread make them in lockstep and prices them apart.
// Pages released rather than moved (the large pool taking small pages of another page size)
// must be free before the growth creates its own, so that path still waits on the host, once;
// allocwatch's defaults never take it (both page sizes are 2 MiB). Every host wait is counted
// (num_host_waits.*), and so is every device-side ordering (num_stream_waits).
#include <algorithm>

#include "allocator.h"

namespace allocwatch {

namespace {

// Free small-pool pages the large pool leaves in place when it takes the rest (Note [page
// policy], small-pool reserve).
constexpr std::size_t kSmallPagesKept = 2;

constexpr std::size_t kNoRoom = static_cast<std::size_t>(-1);

bool allocatable(const Block* b) {
  return b != nullptr && b->is_free();
}

std::size_t whole_pages(std::size_t bytes, std::size_t page) {
  return (bytes + page - 1) / page * page;
}

}  // namespace

Block* CachingAllocator::find_expandable_block(StreamId stream, BlockPool* pool,
                                               std::size_t size, bool fewest_new_pages) {
  // The lowest address where `size` fits in unmapped space, possibly together with the free
  // blocks around it: growing at the lowest address keeps each segment one piece. With
  // fewest_new_pages, the place of all those where the least of `size` is unmapped (Note
  // [page policy], repeated moves).
  auto unmapped_bytes = [&](Block* b) {  // of the first `size` bytes; kNoRoom: they do not fit
    std::size_t bytes = 0, unmapped = 0;
    for (; bytes < size && allocatable(b); b = b->next) {
      if (!b->mapped) unmapped += std::min(b->size, size - bytes);
      bytes += b->size;
    }
    return bytes >= size ? unmapped : kNoRoom;
  };
  // With aliased pages a free block counts only where its pages are in use through no other
  // address (Note [aliased pages]).
  auto usable = [&](const Block* c) {
    return !c->expandable->tracks_aliases() || c->expandable->usable(Range{c->ptr, size});
  };
  Block key(stream, 0, nullptr, 0);
  Block* best = nullptr;
  std::size_t best_unmapped = kNoRoom;
  for (auto it = pool->unmapped.lower_bound(&key);
       it != pool->unmapped.end() && (*it)->stream == stream; ++it) {
    Block* c = *it;
    if (allocatable(c->prev)) c = c->prev;
    std::size_t unmapped = unmapped_bytes(c);
    if (unmapped != kNoRoom && !usable(c)) {  // the unmapped space without the block before it
      c = *it;
      unmapped = unmapped_bytes(c);
    }
    if (unmapped == kNoRoom || !usable(c)) continue;
    if (!fewest_new_pages) return c;
    if (unmapped < best_unmapped) {
      best = c;
      best_unmapped = unmapped;
    }
  }
  if (best != nullptr) return best;
  // None: reserve a new segment with address space for all of the device's memory (and an
  // eighth more, so pages unmapped early in a segment can be remapped at its end).
  const std::size_t page = pool->is_small ? kSmallBuffer : config_.expandable_large_page;
  // The large pool's first segment decides whether its pages alias under a limit (Note
  // [aliased pages]), for it and the rest until every one of them is released.
  if (pool == &large_blocks_) {
    auto expandable = [](const Block* b) { return b->expandable != nullptr; };
    if (std::none_of(pool->blocks.begin(), pool->blocks.end(), expandable) &&
        std::none_of(pool->unmapped.begin(), pool->unmapped.end(), expandable))
      alias_under_limit_ = config_.alias_pages_under_limit && page_policy_.limited();
  }
  const std::size_t address_space = device_total_ + device_total_ / 8;
  expandable_segments_.push_back(
      std::make_unique<ExpandableSegment>(*device_, stream, address_space, page));
  ExpandableSegment* es = expandable_segments_.back().get();
  registration_[es->base()] = next_registration_++;
  if (aliasing() && pool == &large_blocks_) {
    auto& shared = shared_physical_[page];
    if (shared == nullptr) shared = std::make_unique<PhysicalPages>(page);
    es->track_aliases(shared.get());
  }
  Block* candidate = new_block(stream, es->size(), pool, es->base());
  candidate->mapped = false;
  candidate->expandable = es;
  pool->unmapped.insert(candidate);
  return candidate;
}

std::size_t CachingAllocator::grow_size(const BlockPool* pool, std::size_t needed) const {
  // PyTorch maps exactly the pages needed. With expandable_grow_mb, the large pool grows by at
  // least that much at a time, in one chunk: fewer, larger device calls.
  if (pool->is_small || config_.expandable_grow == 0) return needed;
  return std::max(needed, config_.expandable_grow);
}

bool CachingAllocator::over_fraction_when_mapping(std::size_t bytes) const {
  // With reuse_free_pages the memory fraction is checked here, after the take-back, against
  // what growth really adds (alloc_block leaves it to this); `native` keeps PyTorch's check
  // (Note [page policy], memory fraction).
  return set_fraction_ && fraction_checked_when_mapping() &&
         total_allocated_memory_ + bytes > allowed_memory_maximum_;
}

std::size_t CachingAllocator::growth_within_fraction(std::size_t size, std::size_t needed,
                                                     std::size_t page) const {
  // Growth beyond the request (expandable_grow_mb) only as far as the memory fraction leaves
  // room: a small request must not fail because its generous growth would not fit.
  if (!(set_fraction_ && fraction_checked_when_mapping()) || size <= needed) return size;
  const std::size_t room = allowed_memory_maximum_ > total_allocated_memory_
                               ? allowed_memory_maximum_ - total_allocated_memory_
                               : 0;
  return std::max(whole_pages(needed, page), std::min(size, room / page * page));
}

std::size_t CachingAllocator::growth_chunk_pages(const BlockPool& pool, std::size_t size,
                                                 std::size_t page) const {
  // Large-pool growth maps whole chunks where it can (few calls), single pages at the ends
  // (easy to give back; ExpandableSegment::map lays them out; Note [page policy], page size
  // and chunks). The small pool maps its 2 MiB pages one by one, as PyTorch does.
  if (pool.is_small) return 1;
  if (config_.expandable_grow > 0) return whole_pages(size, page) / page;
  if (config_.expandable_chunk > page &&
      !page_policy_.single_pages(total_allocated_memory_ + size))
    return config_.expandable_chunk / page;
  return 1;
}

bool CachingAllocator::should_take_back(std::size_t bytes) const {
  // Only where growing by `bytes` would raise reserved memory above its high-water mark, or
  // pass the memory fraction; never during a capture (Note [page policy], high-water mark and
  // captures). A device with no memory left is map_block's second try.
  return config_.reuse_free_pages && !captures_underway() &&
         (page_policy_.above_high_water(total_allocated_memory_ + bytes) ||
          over_fraction_when_mapping(bytes));
}

void CachingAllocator::release_spares_beyond(std::size_t keep_pages, std::size_t page) {
  // Taken-back chunks are mapped as they are (largest first) where they fit in the range being
  // mapped. Those that will not fit go back to the device before anything is created, so that
  // physical memory never holds both (it could run the device out, or pass the cap). A moved
  // chunk's memory still goes only with its old address, once the device is past the move (the
  // driver frees a released allocation at its last unmap): until then it serves nobody, which
  // costs capped runs (docs/benchmarks.md, "Repeated passes"; an open cost).
  std::sort(spare_pages_.begin(), spare_pages_.end(),
            [](const SparePhysical& a, const SparePhysical& b) { return a.pages > b.pages; });
  std::vector<SparePhysical> kept;
  for (const SparePhysical& s : spare_pages_) {
    if (s.alias && s.pages > keep_pages) continue;  // mapped where it is: nothing to release
    if (s.pages <= keep_pages) {
      keep_pages -= s.pages;
      kept.push_back(s);
    } else {
      device_->release_physical(s.handle, s.pages * page);
    }
  }
  spare_pages_ = std::move(kept);
}

bool CachingAllocator::map_block(Block* to_map, std::size_t size, std::size_t needed) {
  ExpandableSegment* es = to_map->expandable;
  const std::size_t page = es->page_size();
  size = growth_within_fraction(size, needed, page);
  std::size_t chunk_pages = growth_chunk_pages(*to_map->pool, size, page);
  const std::size_t rounded = whole_pages(size, page);
  // Taken-back pages never outlive this call, even when a device call throws: another
  // segment (whose page size may differ) must not map or release them.
  struct ReleaseSparesOnExit {
    CachingAllocator& a;
    std::size_t page;
    ~ReleaseSparesOnExit() {
      try {
        a.release_spares_beyond(0, page);
      } catch (...) {
      }
    }
  } release_spares_on_exit{*this, page};

  // Past the memory fraction pages move regardless: they are the only room left.
  // A growth that took pages back once and needs to again is a cycle: the pages it moves will
  // be moved back before it recurs, so it creates them (Note [page policy], repeated moves).
  // Pages in use nowhere come first, mapped here too (Note [aliased pages]); what they leave
  // follows the rules above.
  std::size_t aliased = 0;
  SparePhysical last{0, 0, true};  // a chunk partly in use, for the range's last pages
  std::size_t last_free = 0;
  if (aliasing() && es->tracks_aliases() && !captures_underway()) {
    for (const SparePhysical& s : es->idle_handles(growing_, rounded / page)) {
      spare_pages_.push_back(s);
      aliased += s.pages * page;
    }
    // Its other pages lie past the range: only where the unmapped space leaves them room.
    const std::size_t room = to_map->size / page;
    if (rounded > aliased && room > rounded / page) {
      last = es->partly_idle_chunk(growing_, (rounded - aliased) / page, room - rounded / page + 1,
                                   spare_pages_, &last_free);
      if (last.pages > 0) aliased += std::min(last_free * page, rounded - aliased);
    }
  }
  const std::size_t rest = rounded - aliased;
  const bool took_back =
      rest > 0 && should_take_back(rest) &&
      (over_fraction_when_mapping(rest) || !config_.settle_page_moves ||
       !page_policy_.repeats_page_move());
  if (took_back) take_back_free_pages(to_map->pool, to_map, rest);
  if (over_fraction_when_mapping(rest)) {
    // Still over the memory fraction: pages taken back go to the device, and the caller's
    // out-of-memory path frees cached blocks and retries.
    release_spares_beyond(0, page);
    return false;
  }
  // Growth in one chunk (expandable_grow_mb) creates that chunk whole.
  const std::size_t spare_room =
      config_.expandable_grow > 0 && chunk_pages > 1 ? 0 : rounded / page;
  release_spares_beyond(spare_room, page);
  std::size_t alias_bytes = 0;  // of the range mapped: addresses added, no new memory
  Range mapped = es->map(Range{to_map->ptr, size}, chunk_pages, &spare_pages_, &alias_bytes,
                         &last, last_free);
  if (mapped.size == 0) {
    // The device refused: what it had left marks the ceiling, and from here growth nears it.
    std::size_t device_free = 0;  // unknown: the ceiling is what is reserved
    try {
      device_free = device_->memory_info().free;
    } catch (...) {
    }
    page_policy_.growth_refused(total_allocated_memory_ + device_free);
    chunk_pages = growth_chunk_pages(*to_map->pool, size, page);
  }
  if (chunk_pages != 1) grown_in_single_pages_ = false;
  // The device had no memory left for pages below the high-water mark: take back after all.
  if (mapped.size == 0 && !took_back && config_.reuse_free_pages && !captures_underway() &&
      take_back_free_pages(to_map->pool, to_map, rest) > 0) {
    release_spares_beyond(spare_room, page);
    mapped = es->map(Range{to_map->ptr, size}, chunk_pages, &spare_pages_, &alias_bytes, &last,
                     last_free);
  }
  // Pages taken back but not mapped (a chunk was mapped instead, or the map failed) are
  // returned to the device.
  release_spares_beyond(0, page);
  if (mapped.size == 0) return false;
  adopt_mapped(to_map, mapped);
  if (mapped.size > alias_bytes)
    count_reserved(*to_map->pool, TraceAction::segment_map, mapped.ptr,
                   mapped.size - alias_bytes, to_map->stream);
  // Memory past the ceiling was there after all (another process freed some): forget it.
  page_policy_.mapped(total_allocated_memory_);
  return true;
}

void CachingAllocator::adopt_mapped(Block* to_map, Range mapped) {
  // The mapped front of the unmapped block becomes a free block, merged with free neighbours;
  // the rest stays unmapped: to_map -> remaining (still unmapped) -> to_map->next.
  BlockPool& pool = *to_map->pool;
  pool.unmapped.erase(to_map);
  to_map->mapped = true;
  if (mapped.size < to_map->size) {
    Block* remaining = new_block(to_map->stream, to_map->size - mapped.size, &pool,
                                 to_map->ptr + mapped.size);
    remaining->mapped = false;
    remaining->expandable = to_map->expandable;
    remaining->splice(to_map, to_map->next);
    pool.unmapped.insert(remaining);
    to_map->size = mapped.size;
  }
  // A growth that starts here, passing over a free block before it whose pages are in use
  // through other addresses, must not take that block's front (Note [aliased pages]).
  if (!(to_map->expandable->tracks_aliases() && to_map->ptr == growing_.ptr))
    try_merge_blocks(to_map, to_map->prev, pool);
  try_merge_blocks(to_map, to_map->next, pool);
  pool.insert_into_blocks(to_map);
}

Block* CachingAllocator::try_allocate_expandable_block(StreamId stream, BlockPool* pool,
                                                       std::size_t size) {
  page_policy_.begin_growth(
      stream, size, static_cast<std::size_t>(stats_.allocated_bytes.by_pool[kAggregate].current));
  // A growth that will create the pages it once moved grows where it needs the fewest (Note
  // [page policy], repeated moves).
  const bool settled = config_.settle_page_moves && page_policy_.growth_moved_before();
  Block* candidate = find_expandable_block(stream, pool, size, settled);
  growing_ = Range{candidate->ptr, size};
  grown_in_single_pages_ = config_.align_to_pages;  // map_block clears it where it chunks
  // The candidate starts a run of free and unmapped blocks with at least `size` bytes:
  //   unmapped -> null | unmapped -> free -> ... | free -> unmapped -> ...
  if (!candidate->mapped &&
      !map_block(candidate, std::min(candidate->size, grow_size(pool, size)),
                 std::min(candidate->size, size))) {
    return nullptr;
  }
  while (candidate->size < size) {
    // free -> unmapped: map part of the unmapped block; it merges into the free one.
    std::size_t remaining = size - candidate->size;
    Block* next = candidate->next;
    if (!map_block(next, std::min(grow_size(pool, remaining), next->size),
                   std::min(remaining, next->size))) {
      return nullptr;
    }
    candidate = next;
  }
  pool->blocks.erase(candidate);
  if (grown_in_single_pages_) {
    if (const std::size_t gap = page_alignment_gap(candidate, size)) {
      // The front, up to the page boundary, stays behind as a free block of its own.
      Block* front = new_block(stream, gap, pool, candidate->ptr);
      front->expandable = candidate->expandable;
      front->splice(candidate->prev, candidate);
      pool->insert_into_blocks(front);
      candidate->ptr += gap;
      candidate->size -= gap;
    }
  }
  return candidate;
}

Block* CachingAllocator::carve_pages(Block* block, Range r) {
  BlockPool& pool = *block->pool;
  pool.blocks.erase(block);
  // The partial pages at either end stay mapped as free blocks of their own.
  const std::size_t before = r.ptr - block->ptr;
  if (before > 0) {
    Block* before_free = new_block(block->stream, before, &pool, block->ptr);
    before_free->expandable = block->expandable;
    before_free->splice(block->prev, block);
    pool.insert_into_blocks(before_free);
  }
  const std::size_t after = block->size - (before + r.size);
  if (after > 0) {
    Block* after_free = new_block(block->stream, after, &pool, r.ptr + r.size);
    after_free->expandable = block->expandable;
    after_free->splice(block, block->next);
    pool.insert_into_blocks(after_free);
  }
  block->ptr = r.ptr;
  block->size = r.size;
  block->mapped = false;
  return block;
}

std::size_t CachingAllocator::unmap_block(Block* block, std::size_t limit,
                                          std::vector<SparePhysical>* keep) {
  // Returns the physical bytes released: an aliased page loses one address, and its memory
  // goes with its last (Note [aliased pages]).
  std::size_t released = 0;
  Range unmapped =
      block->expandable->unmap(Range{block->ptr, block->size}, limit, keep, &released);
  if (unmapped.size == 0) return 0;
  carve_pages(block, unmapped);
  become_unmapped_space(block);
  if (released > 0)
    count_released(*block->pool, TraceAction::segment_unmap, unmapped.ptr, released,
                   block->stream);
  return released;
}

std::vector<StreamId> CachingAllocator::streams_in_use() const {
  std::vector<StreamId> streams;
  for (const auto& es : expandable_segments_) streams.push_back(es->stream());
  std::sort(streams.begin(), streams.end());
  streams.erase(std::unique(streams.begin(), streams.end()), streams.end());
  return streams;
}

std::size_t CachingAllocator::move_pages(Block* block, std::size_t limit, StreamId receiver) {
  // Note [moving pages]: mapped elsewhere now, ordered on the device, unmapped here later.
  PageMove move;
  const Range moved =
      block->expandable->detach(Range{block->ptr, block->size}, limit, &spare_pages_,
                                &move.still_mapped);
  if (moved.size == 0) return 0;
  const StreamId donor = block->stream;
  BlockPool& pool = *block->pool;
  move.blocks.push_back(carve_pages(block, moved));
  move.blocks.back()->unmap_pending = true;
  count_released(pool, TraceAction::segment_unmap, moved.ptr, moved.size, donor);
  order_page_move(std::move(move), {donor}, receiver);
  return moved.size;
}

std::size_t CachingAllocator::move_idle_physical(const PhysicalPages& physical, BlockPool& pool,
                                                 std::size_t bytes, StreamId receiver) {
  // Each address lies inside a free block (the allocation is in use through none): carved out
  // as move_pages does, all unmapped once every stream is past the move. Only from the ends of
  // free blocks: carving an address out of the middle of one cuts the range its pool grows and
  // aliases into (measured: more memory on a trainer's trace).
  auto free_block_over = [&](const ExpandableSegment* es, Range r) -> Block* {
    for (Block* b : pool.blocks)
      if (b->expandable == es && b->mapped && b->ptr <= r.ptr && r.ptr + r.size <= b->ptr + b->size)
        return b;
    return nullptr;
  };
  auto at_an_end = [&](const std::pair<ExpandableSegment*, Range>& a) {
    const Block* b = free_block_over(a.first, a.second);
    const Range r = a.second;
    return b != nullptr && (r.ptr == b->ptr || b->ptr + b->size == r.ptr + r.size);
  };
  // The next allocation to move: at either end of a free block, every address at an end.
  auto next_idle = [&]() -> ExpandableSegment::IdlePhysical {
    for (const Block* b : pool.blocks) {
      if (b->expandable == nullptr || !b->mapped || &b->expandable->physical() != &physical)
        continue;
      for (bool front : {true, false}) {
        ExpandableSegment::IdlePhysical p = b->expandable->idle_chunk(Range{b->ptr, b->size}, front);
        if (p.pages > 0 && std::all_of(p.addresses.begin(), p.addresses.end(), at_an_end))
          return p;
      }
    }
    return {};
  };
  PageMove move;
  std::vector<StreamId> donors;
  std::size_t taken = 0;
  while (taken < bytes) {
    const ExpandableSegment::IdlePhysical p = next_idle();
    if (p.pages == 0) break;
    ExpandableSegment::detach_physical(p, &spare_pages_);
    for (const auto& [es, r] : p.addresses) {
      move.blocks.push_back(carve_pages(free_block_over(es, r), r));
      move.blocks.back()->unmap_pending = true;
      move.still_mapped.push_back(r);
      if (std::find(donors.begin(), donors.end(), es->stream()) == donors.end())
        donors.push_back(es->stream());
    }
    const std::size_t n = p.pages * physical.page_size();
    const auto& [es, r] = p.addresses.front();
    count_released(pool, TraceAction::segment_unmap, r.ptr, n, es->stream());
    taken += n;
  }
  if (taken > 0) order_page_move(std::move(move), donors, receiver);
  return taken;
}

void CachingAllocator::order_page_move(PageMove move, const std::vector<StreamId>& donors,
                                       StreamId receiver) {
  for (StreamId s : streams_in_use()) {
    const EventId event = device_->record_event(s);
    move.events.push_back(event);
    if (s != receiver && std::find(donors.begin(), donors.end(), s) != donors.end()) {
      device_->stream_wait_event(receiver, event);
      stats_.num_stream_waits++;
    }
  }
  page_moves_.push_back(std::move(move));
}

void CachingAllocator::wait_on_device(
    StreamId stream, const std::vector<std::pair<StreamId, std::uint64_t>>& others) {
  for (const auto& [other, seq] : others) {
    if (captures_underway()) {
      // An event recorded during a capture is a node of its graph: used once, never kept.
      const EventId event = device_->record_event(other);
      device_->stream_wait_event(stream, event);
      device_->release_event(event);
      stats_.num_stream_waits++;
      continue;
    }
    FreeEvents& events = free_events_[other];
    // An event of the free's number or later that completed: that work is done.
    if (seq != 0 && free_events_done_[other] >= seq) continue;
    auto it = seq == 0 ? events.end()
                       : std::lower_bound(events.begin(), events.end(),
                                          std::make_pair(seq, EventId{0}));
    EventId event = 0;
    if (it == events.end()) {
      // None recorded since the free (or no free known): all the other stream has queued
      // comes first.
      record_free_event(other);
      event = events.back().second;
    } else if (device_->query_event(it->second)) {
      drop_free_events_through(other, it);
      continue;
    } else {
      event = it->second;
    }
    device_->stream_wait_event(stream, event);
    stats_.num_stream_waits++;
  }
}

void CachingAllocator::drop_free_events_through(StreamId stream, FreeEvents::iterator last) {
  FreeEvents& events = free_events_[stream];
  free_events_done_[stream] = std::max(free_events_done_[stream], last->first);
  const auto end = std::next(last);
  for (auto it = events.begin(); it != end; ++it) device_->release_event(it->second);
  events.erase(events.begin(), end);
}

void CachingAllocator::trim_free_events(StreamId stream) {
  FreeEvents& events = free_events_[stream];
  // Complete ones form a prefix: bisect for its end.
  std::size_t lo = 0, hi = events.size();  // [0, lo) complete; [hi, size) not
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (device_->query_event(events[mid].second)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo > 0)
    drop_free_events_through(stream, events.begin() + static_cast<std::ptrdiff_t>(lo - 1));
}

void CachingAllocator::finish_page_moves(bool wait) {
  // Oldest first; a move whose events have not all completed holds up none after it, as one
  // slow stream must not hold up the others.
  for (auto it = page_moves_.begin(); it != page_moves_.end();) {
    if (it->unmap_ticket == 0) {
      auto& events = it->events;
      events.erase(std::remove_if(events.begin(), events.end(),
                                  [&](EventId e) {
                                    if (wait) {
                                      host_wait_event(e);
                                    } else if (!device_->query_event(e)) {
                                      return false;
                                    }
                                    device_->release_event(e);
                                    return true;
                                  }),
                   events.end());
      if (!events.empty()) {
        ++it;
        continue;
      }
      const Device::UnmapThread where = device_->unmap_thread();
      if (config_.unmap_off_thread && where != Device::UnmapThread::caller) {
        it->unmap_ticket = unmapper_->submit(it->still_mapped);
        // A replay's device: the same calls, in one order (not a wait a GPU run makes, so
        // not counted as one).
        if (where == Device::UnmapThread::own_in_lockstep) unmapper_->wait(it->unmap_ticket);
      } else {
        for (const Range& r : it->still_mapped) device_->unmap(r.ptr, r.size);
      }
    }
    if (it->unmap_ticket != 0 && !unmapper_->done(it->unmap_ticket)) {
      if (!wait) {
        ++it;
        continue;
      }
      stats_.num_host_waits_unmap_thread++;
      unmapper_->wait(it->unmap_ticket);
    }
    finish_page_move(*it);
    it = page_moves_.erase(it);
  }
}

void CachingAllocator::finish_page_move(const PageMove& move) {
  // Unmapped: the address space joins the unmapped space around it.
  for (Block* block : move.blocks) {
    block->unmap_pending = false;
    become_unmapped_space(block);
  }
}

void CachingAllocator::become_unmapped_space(Block* block) {
  BlockPool& pool = *block->pool;
  try_merge_blocks(block, block->prev, pool);
  try_merge_blocks(block, block->next, pool);
  pool.unmapped.insert(block);
}

void CachingAllocator::release_expandable_segment(Block* block) {
  // The whole segment is one unmapped block: give its address space back.
  block->pool->unmapped.erase(block);
  ExpandableSegment* es = block->expandable;
  delete_block(block);
  registration_.erase(es->base());
  expandable_segments_.erase(
      std::find_if(expandable_segments_.begin(), expandable_segments_.end(),
                   [&](const std::unique_ptr<ExpandableSegment>& p) { return p.get() == es; }));
}

std::size_t CachingAllocator::take_back_free_pages(BlockPool* pool, Block* exclude,
                                                   std::size_t bytes) {
  // Unmaps wholly free pages, the pool's own first, then its sibling's beyond the small-pool
  // reserve, largest free blocks first, until `bytes` are taken (Note [page policy]). Pages of
  // the growing segment's page size are kept in spare_pages_ for map_block; others are
  // released.
  const std::size_t page = exclude->expandable->page_size();
  BlockPool* sibling = nullptr;
  if (pool->owner == nullptr) {
    sibling = pool->is_small ? &large_blocks_ : &small_blocks_;
  } else {
    sibling = pool->is_small ? &pool->owner->large_blocks : &pool->owner->small_blocks;
  }
  // Pages released rather than moved are waited for on the host, once (Note [moving pages]).
  bool device_idle = false;
  std::size_t taken = 0;
  for (BlockPool* from : {pool, sibling}) {
    // The large pool taking small pages (moved or released): only beyond the reserve.
    const bool from_small_reserve = from == sibling && !pool->is_small;
    std::vector<Block*> donors;
    for (Block* b : from->blocks) {
      if (b->expandable == nullptr || b->size < b->expandable->page_size()) continue;
      // A donor next to the range being mapped would merge its hole into that range; one
      // inside the growth's run is part of the request.
      if (b == exclude || b->prev == exclude || b->next == exclude) continue;
      if (b->ptr < growing_.ptr + growing_.size && growing_.ptr < b->ptr + b->size) continue;
      // Aliased pages are mapped again, not moved: those the growing segment shares were
      // offered already, and a page mapped at several addresses moves only whole (below).
      if (b->expandable->tracks_aliases() &&
          (&b->expandable->physical() == &exclude->expandable->physical() ||
           b->expandable->has_aliases(Range{b->ptr, b->size})))
        continue;
      donors.push_back(b);
    }
    std::sort(donors.begin(), donors.end(), [](const Block* a, const Block* b) {
      return a->size > b->size;
    });
    std::size_t budget = bytes;
    if (from_small_reserve) {
      // In free bytes, partly used pages' included (Note [page policy], small-pool reserve).
      std::size_t free_pages_bytes = 0;
      for (const Block* b : donors) free_pages_bytes += b->size;
      const std::size_t reserve = kSmallPagesKept * kSmallBuffer;
      budget = free_pages_bytes > reserve ? free_pages_bytes - reserve : 0;
    }
    for (Block* b : donors) {
      if (taken >= bytes || budget == 0) return taken;
      const std::size_t limit = std::min(bytes - taken, budget);
      std::size_t got = 0;
      if (b->expandable->page_size() == page) {
        got = move_pages(b, limit, exclude->stream);
      } else {
        if (!device_idle) {
          host_wait_device();
          device_idle = true;
        }
        got = unmap_block(b, limit);
      }
      taken += got;
      if (from_small_reserve) budget -= std::min(budget, got);
    }
    // Then the physical memory of segments with aliased pages, whole (Note [aliased pages]).
    // Segments that share them with the growing one map them there instead (idle_handles).
    if (from == &large_blocks_ && taken < bytes) {
      for (const auto& [shared_page, physical] : shared_physical_) {
        if (taken >= bytes) break;
        if (shared_page == page && physical.get() != &exclude->expandable->physical())
          taken += move_idle_physical(*physical, *from, bytes - taken, exclude->stream);
      }
    }
  }
  return taken;
}

}  // namespace allocwatch
