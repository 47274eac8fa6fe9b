// The caching allocator for one device.
//
// It follows PyTorch's CUDA caching allocator rule for rule (see sizes.h for the size classes,
// and the comments in allocator.cpp for each rule's reason), so that a trace replayed with
// PyTorch's defaults reproduces what PyTorch did; allocwatch's own settings (config.h) then
// fragment less. Every public method takes the allocator's lock; private ones assume it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block.h"
#include "capture_graphs.h"
#include "checkpoint.h"
#include "config.h"
#include "counted_device.h"
#include "device.h"
#include "expandable_segment.h"
#include "page_policy.h"
#include "pointer_map.h"
#include "stats.h"
#include "trace.h"
#include "unmapper.h"

namespace allocwatch {

// Why a request could not be met even after releasing cached memory: what was asked, what the
// device has, what is allocated and reserved, and what would help.
struct OutOfMemoryReport {
  std::string message;  // all of it, in words
  std::size_t requested = 0, device_free = 0, device_total = 0, allocated = 0, reserved = 0;
  // The device allocation the request needed (PyTorch's "Tried to allocate"), the memory
  // fraction's limit in bytes (0: none), and the message's last part: which setting would
  // help and the settings in force, for callers that word the rest themselves.
  std::size_t alloc_size = 0, limit = 0;
  std::string advice;
};

// The report as an exception, for callers that want one (malloc without a report to fill).
class OutOfMemoryError : public std::runtime_error, public OutOfMemoryReport {
 public:
  explicit OutOfMemoryError(OutOfMemoryReport report)
      : std::runtime_error(report.message), OutOfMemoryReport(std::move(report)) {}
};

// A block of an expandable segment as another process can map it (export_ipc): the physical
// allocations under it as file descriptors (the device's, valid while they are mapped here),
// with their sizes, back to back; the block starts `offset` bytes into the first.
struct IpcExport {
  std::size_t offset = 0;
  std::vector<std::pair<int, std::size_t>> pieces;
};

// The allocation a block belongs to (segment_of): size 0 when none.
struct SegmentSpan {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  bool expandable = false;
};

// One block of a snapshot, as torch.cuda.memory._snapshot() describes it.
struct BlockInfo {
  std::uintptr_t address;
  std::size_t size;
  std::size_t requested_size;
  const char* state;  // "active_allocated", "active_pending_free", "inactive"
};

struct SegmentInfo {
  std::uintptr_t address = 0;
  std::size_t total_size = 0, allocated_size = 0, active_size = 0, requested_size = 0;
  StreamId stream = 0;
  bool is_large = false;
  bool is_expandable = false;
  MempoolId pool_id{0, 0};
  // The segment's place in the order segments were created (an expandable segment's mapped
  // ranges share its own): NCCL registers a pool's segments in this order, the same on every
  // rank, as PyTorch's snapshot gives it.
  std::int32_t registration_counter = -1;
  std::vector<BlockInfo> blocks;
};

class CachingAllocator {
 public:
  CachingAllocator(std::shared_ptr<Device> device, AllocatorConfig config);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // --- the hot path ---
  // Out of memory: throws OutOfMemoryError, or, given a report to fill, fills it and returns
  // nullptr (no exception: the native back end's path, where none may cross libraries).
  void* malloc(std::size_t size, StreamId stream, OutOfMemoryReport* oom = nullptr);
  void free(void* ptr);
  // free() for a caller that does not know which allocator handed `ptr` out (a DataPtr's
  // deleter knows no device): false, and nothing changed, where this one did not.
  bool free_if_owned(void* ptr);
  // The block at ptr is in use on `stream` as well: do not reuse it before that work is done.
  void record_stream(void* ptr, StreamId stream);
  std::size_t block_size(void* ptr) const;
  // The largest cached free block of the large pool (what cuDNN's benchmark mode asks, through
  // PyTorch's cacheInfo, to size its workspace); 0 when none.
  std::size_t largest_free_block() const;
  // The most a new block could get, as PyTorch's cacheInfo answers when given no guess (cuDNN
  // asks for every convolution it plans, to choose algorithms whose workspace fits): the
  // larger of the device's free memory and largest_free_block(). The device is asked at most
  // once every `fresh_for`; in between its answer is adjusted by what this allocator has
  // reserved or released since, the only change to the device that this process makes.
  std::size_t workspace_room(std::chrono::nanoseconds fresh_for);

  // --- reclaiming ---
  // Both release nothing (and return 0) while a CUDA graph is being captured anywhere in the
  // process: releasing waits for streams, and CUDA's default (global) capture mode forbids
  // that from any thread while any stream captures. captures_underway() says whether one is.
  std::size_t empty_cache();       // release every cached block that is not split
  std::size_t garbage_collect();   // release aged cached blocks down to the GC threshold
  static bool captures_underway();  // begin_allocate_to_pool .. end, any allocator
  void process_events();           // recycle pending blocks whose events completed

  // --- limits and settings ---
  void set_memory_fraction(double fraction);  // of the device's total memory
  void set_memory_limit(std::size_t bytes);   // the same, in bytes (0: no limit)
  std::size_t memory_limit() const;
  AllocatorConfig config() const;
  void set_config(const std::string& update);  // only the named keys change; atomic

  // --- statistics ---
  std::map<std::string, std::int64_t> stats() const;
  // stats()["reserved_bytes.all.current"] alone, without building the map: for a caller that
  // reads it after every allocation (replay's peak watch).
  std::int64_t reserved_bytes() const;
  // Whether the general large pool's pages alias (alias_pages, or alias_pages_under_limit in
  // force when its first segment was made): a snapshot then lists a page at each address.
  bool aliases_pages() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Allocated and reserved bytes at their highest since the previous call (or since the
  // allocator was made), then a new window starting from the current values. Independent of
  // reset_peak_stats(): the user's peaks are never touched.
  IntervalPeaks take_interval_peaks();

  // --- private pools for CUDA graph capture ---
  // Makes the pool if it does not exist (plain_segments: PrivatePool's), else shares it.
  void begin_allocate_to_pool(MempoolId id, std::function<bool(StreamId)> filter,
                              bool plain_segments = false);
  void end_allocate_to_pool(MempoolId id);
  void release_pool(MempoolId id);

  // --- private pools for torch.cuda.MemPool (pools.cpp) ---
  // Makes the pool, or shares an existing one (its use count + 1); begin_allocate_to_pool
  // then routes a thread's or stream's allocations to it. plain_segments: PrivatePool's.
  // segments: the device its segments come from (PrivatePool::segments; nullptr: this
  // allocator's), for a new pool only.
  void create_or_incref_pool(MempoolId id, bool plain_segments,
                             std::shared_ptr<Device> segments = nullptr);
  int pool_use_count(MempoolId id) const;  // 0 for a pool that does not exist
  void set_pool_no_split(MempoolId id);
  // PyTorch's use_on_oom: a request outside private pools that found no room anywhere else
  // takes a free block of such a pool (in the order the pools were marked) before it fails.
  // A pool released by all its users is no longer used so.
  void set_pool_use_on_oom(MempoolId id, bool use_on_oom);
  // Releases the cached blocks of a pool that nothing uses any more (PyTorch's
  // emptyCache(pool)); nothing for a pool still in use, or while a capture is underway.
  std::size_t empty_pool_cache(MempoolId id);
  // Whether the pool's allocated blocks are exactly those at `expected` (CUDA graph trees'
  // check that no tensor of a recorded graph is still alive).
  bool check_pool_live_allocations(MempoolId id, const std::vector<std::uintptr_t>& expected) const;

  // Reuse during a capture of blocks freed while other streams used them, where the capture's
  // graph orders those uses (capture_graphs.h; nullptr: they wait for the capture's end).
  void set_capture_graphs(std::shared_ptr<CaptureGraphs> graphs);

  // --- checkpoints of a private pool's layout (checkpoint.cpp) ---
  PoolCheckpoint checkpoint_pool(MempoolId id);
  CheckpointRestore restore_pool(const PoolCheckpoint& checkpoint);

  // The allocation `ptr` (an allocated block's address) belongs to: for an ordinary segment
  // the whole segment, for an expandable one the block itself (pools.cpp).
  SegmentSpan segment_of(const void* ptr) const;
  // The allocated block at `ptr`, of an expandable segment, for another process (CUDA IPC);
  // throws std::invalid_argument for another block, DeviceError where the device cannot share.
  IpcExport export_ipc(const void* ptr);

  // --- history and inspection ---
  void record_history(bool enabled, std::size_t max_entries);
  void clear_history();
  void set_trace_skipped(std::uint32_t actions);  // trace_action_bit of each action left out
  void add_trace_observer(TraceObserver observer);
  std::vector<TraceEntry> trace() const;
  bool trace_wrapped() const;
  std::vector<SegmentInfo> snapshot();
  // Walks every segment and recounts: an empty string when all invariants hold, otherwise a
  // description of the first violation. For tests and the soak run; takes time linear in the
  // number of blocks.
  std::string check_invariants() const;

  Device& device() { return *device_; }

 private:
  struct AllocParams {
    std::size_t size;        // rounded request
    std::size_t orig_size;
    StreamId stream;
    BlockPool* pool;
    std::size_t alloc_size;  // size of a new segment
    Block* block = nullptr;
    // Where get_free_block found `block` in the pool: it stays cached until
    // alloc_found_block decides whether it can keep its place there.
    bool cached = false;
    BlockPool::FreeSet::iterator cached_at{};
  };

  BlockPool& get_pool(std::size_t size, StreamId stream);
  bool get_free_block(AllocParams& p);
  std::size_t largest_free_block_locked() const;
  // Note [pool allocators outside the lock]. A pool's own allocator (PrivatePool::segments: the
  // user's, through torch.cuda.MemPool(allocator=...)) may call back into PyTorch, and so into
  // this allocator, whose lock is not re-entrant: a Python allocator that logs
  // torch.cuda.memory_allocated(), a free function that allocates. It is never called with
  // mutex_ held. Its frees are queued under the lock (outside_) and run once the lock is let go
  // (Lock). malloc runs in passes under the lock (MallocRound): where a pass needs a segment
  // from such an allocator, or has queued frees that must happen before its next attempt (as
  // PyTorch frees before it retries), it stops, the lock is let go for that work, and the next
  // pass takes up the attempt where it stopped, looking for a free block again first, since
  // other threads ran meanwhile.
  struct OutsideWork {
    std::shared_ptr<Device> from;  // keeps the pool's allocator alive until the work ran
    void* ptr = nullptr;           // a segment to free; nullptr: only the reference to drop
    std::size_t size = 0;
  };
  class Lock;
  struct MallocRound;
  // malloc's hot path: looks through the cached blocks and serves from one if it can;
  // otherwise returns nullptr with `p` set for the request.
  void* malloc_cached(std::size_t orig_size, StreamId stream, AllocParams& p);
  void set_params(AllocParams& p, std::size_t orig_size, StreamId stream);
  // Serves the request from p.block under the rules of the pool it belongs to.
  void* serve(AllocParams& p, const PrivatePool* requested_by);
  // No cached block served: passes under the lock until one is found or made.
  void* malloc_new_segment(Lock& lock, const AllocParams& looked, OutOfMemoryReport* oom);
  void* malloc_pass(std::size_t orig_size, StreamId stream, OutOfMemoryReport* oom,
                    MallocRound& round);
  // PyTorch's attempts at a new segment, from round.stage on: a new segment; again after
  // releasing oversize cached blocks; again after releasing every cached block (a retry).
  bool alloc_attempts(AllocParams& p, MallocRound& round);
  bool alloc_block(AllocParams& p, bool is_retry, MallocRound& round);
  // A segment of a pool's allocator that malloc did not use goes back to it, outside the lock.
  void give_back(MallocRound& round);
  // Erases a private pool; the last reference to its allocator, if it has one, goes outside
  // the lock.
  void drop_pool(MempoolId id);
  Block* alloc_found_block(AllocParams& p, bool split_remainder);
  std::size_t page_alignment_gap(const Block* block, std::size_t size) const;
  bool should_split(const Block* block, std::size_t size) const;
  void free_block(Block* block);
  // free() of a block already taken out of allocated_.
  void free_allocated(Block* block);
  Block* merge_into_cached_next(Block* block, BlockPool& pool);
  std::size_t try_merge_blocks(Block* dst, Block* src, BlockPool& pool);
  OutOfMemoryReport out_of_memory(const AllocParams& p);

  // Reserved memory's bookkeeping, in one place: `size` bytes at `ptr` became reserved (a new
  // segment, `how` = segment_alloc, or pages mapped into an expandable one, segment_map) or
  // went back to the device (segment_free, segment_unmap). The total the fraction checks, the
  // high-water mark, the statistics, the device-call counters, the trace and a private pool's
  // counts all change here and nowhere else.
  void count_reserved(BlockPool& pool, TraceAction how, std::uintptr_t ptr, std::size_t size,
                      StreamId stream);
  void count_released(BlockPool& pool, TraceAction how, std::uintptr_t ptr, std::size_t size,
                      StreamId stream);

  // Releasing memory to the device.
  bool release_available_cached_blocks(const AllocParams& p);
  std::size_t release_cached_blocks();
  std::size_t release_blocks(BlockPool& pool);
  void release_block(Block* block);
  std::size_t garbage_collect_cached_blocks();

  // Expandable segments.
  Block* find_expandable_block(StreamId stream, BlockPool* pool, std::size_t size,
                               bool fewest_new_pages);
  // Maps `size` bytes at the start of an unmapped block, of which `needed` serve the request.
  bool map_block(Block* to_map, std::size_t size, std::size_t needed);
  // map_block's decisions (expandable.cpp, Note [page policy]).
  bool over_fraction_when_mapping(std::size_t bytes) const;
  std::size_t growth_within_fraction(std::size_t size, std::size_t needed,
                                     std::size_t page) const;
  std::size_t growth_chunk_pages(const BlockPool& pool, std::size_t size,
                                 std::size_t page) const;
  bool should_take_back(std::size_t bytes) const;
  void create_or_incref_pool_locked(MempoolId id, bool plain_segments,
                                    std::shared_ptr<Device> segments = nullptr);  // mutex_ held
  bool get_free_block_of_use_on_oom_pools(AllocParams& p);
  void release_spares_beyond(std::size_t keep_pages, std::size_t page);
  void adopt_mapped(Block* to_map, Range mapped);
  Block* try_allocate_expandable_block(StreamId stream, BlockPool* pool, std::size_t size);
  // An explicit reclaim's wait for the stream of `block`'s segment before its pages are unmapped
  // now, once a stream (`waited`: the streams waited for so far).
  void wait_before_unmapping(const Block* block, std::vector<StreamId>& waited);
  // Unmaps the whole pages of a free block now; the caller has waited for the device.
  std::size_t unmap_block(Block* block, std::size_t limit = 0,
                          std::vector<SparePhysical>* keep = nullptr);
  // Moves the whole pages of a free block to spare_pages_ for `receiver`, ordered on the device
  // after the block's stream, and unmaps them here once events say the device is done (Note
  // [moving pages]).
  struct PageMove;
  std::size_t move_pages(Block* block, std::size_t limit, StreamId receiver);
  // The same for a segment with aliased pages: physical allocations in use through none of
  // their addresses leave with all of them, until `bytes` are taken. Returns the bytes moved.
  std::size_t move_idle_physical(const PhysicalPages& physical, BlockPool& pool,
                                 std::size_t bytes, StreamId receiver);
  // Queues the old places' unmap behind events on every stream in use; the receiver waits on
  // the device for the donor's.
  void order_page_move(PageMove move, const std::vector<StreamId>& donors, StreamId receiver);
  // `stream` waits on the device for each other stream's work on pages it was handed
  // (ExpandableSegment::HandOff), where that work may still run.
  void wait_on_device(StreamId stream,
                      const std::vector<std::pair<StreamId, std::uint64_t>>& others);
  // Events recorded when pages that change stream were freed, by stream, oldest first, with
  // their sequence numbers (Note [aliased pages]); a stream's complete in order.
  // A free of aliased pages takes the next sequence number (without an event where its pages
  // never changed stream): an event of that number or later on the stream orders after it.
  using FreeEvents = std::deque<std::pair<std::uint64_t, EventId>>;
  static constexpr std::size_t kFreeEventsBeforeTrim = 64;
  std::map<StreamId, FreeEvents> free_events_;
  std::map<StreamId, std::uint64_t> free_events_done_;  // the last number dropped as complete
  std::uint64_t next_free_seq_ = 1;
  // Records one on `stream`, after all it has queued.
  void record_free_event(StreamId stream);
  // Releases `stream`'s events up to and including `last`, complete.
  void drop_free_events_through(StreamId stream, FreeEvents::iterator last);
  // Drops `stream`'s complete ones (a prefix), found by bisection.
  void trim_free_events(StreamId stream);
  // A block of a segment with aliased pages handed out or freed: out of the hot path's line.
  [[gnu::noinline]] void aliased_pages_handed_out(Block* block);
  [[gnu::noinline]] void aliased_pages_freed(Block* block);
  // The part of a free block that pages [r.ptr, r.ptr + r.size) cover, split from the partial
  // pages at its ends (which stay free blocks) and out of the pool's free set.
  Block* carve_pages(Block* block, Range r);
  // Finishes the moves whose events completed; with wait, every move (waiting on the host).
  void finish_page_moves(bool wait);
  void finish_page_move(const PageMove& move);
  // An unmapped block joins the unmapped address space around it and its pool's set of it.
  void become_unmapped_space(Block* block);
  void release_expandable_segment(Block* block);
  std::size_t take_back_free_pages(BlockPool* pool, Block* exclude, std::size_t bytes);
  std::size_t grow_size(const BlockPool* pool, std::size_t needed) const;
  // With reuse_free_pages the memory fraction is checked when mapping, against what growth
  // adds, not before as PyTorch does (expandable.cpp, Note [page policy]).
  bool fraction_checked_when_mapping() const {
    return config_.expandable_segments && config_.reuse_free_pages;
  }

  // Blocks freed during a capture while other streams used them (pools.cpp).
  void note_freed_in_capture(Block* block);
  void reuse_freed_in_capture(StreamId stream);

  // Events.
  void insert_events(Block* block);
  // reuse_waiting_frees, where reserved memory cannot grow (Note [waiting frees] in
  // allocator.cpp): frees the waiting block of p's stream and pool that best fits p once its
  // freed neighbours join it (where none does, all of them), ordering p's stream after their
  // other streams' uses on the device, and finds p's block; false where none fits (`freed`:
  // whether any block was freed all the same).
  bool reuse_waiting_free(AllocParams& p, bool* freed);
  // Frees the waiting blocks `which` picks, each one's stream waiting on the device for its
  // events; whether any was freed.
  template <typename Which>
  bool free_waiting_blocks(Which which);
  void insert_events_deferred_until_no_capture();
  void process_events_locked();
  void synchronize_and_free_events();
  // Every wait on the host goes through these, so that each is counted.
  void host_wait_device();
  void host_wait_stream(StreamId stream);
  void host_wait_event(EventId event);
  // The streams that allocate from this allocator's expandable segments: those whose work may
  // still touch a free block's pages (Note [moving pages]).
  std::vector<StreamId> streams_in_use() const;

  // Blocks come from an arena: the hot path never calls the system allocator.
  // Checkpoints (checkpoint.cpp).
  PrivatePool& private_pool(MempoolId id) const;
  std::vector<const Block*> segment_heads(const PrivatePool& pool) const;
  void restore_segment(PrivatePool& pool, const SegmentCheckpoint& segment,
                       CheckpointRestore& result);

  Block* new_block(StreamId stream, std::size_t size, BlockPool* pool, std::uintptr_t ptr);
  void delete_block(Block* block);
  std::vector<const Block*> all_blocks() const;

  mutable std::mutex mutex_;
  std::vector<OutsideWork> outside_;  // Note [pool allocators outside the lock]; under mutex_
  std::shared_ptr<Device> device_;  // the back end, through counted_
  CountedDevice* counted_ = nullptr;  // num_device_calls.* (counted_device.h)
  // Unmaps moved pages' old places off the allocating thread where unmap_off_thread and the
  // device allow it (core/unmapper.h). Declared after device_, so destroyed (joined) before it.
  std::unique_ptr<Unmapper> unmapper_;
  AllocatorConfig config_;
  DeviceStats stats_;
  BlockPool large_blocks_{false};
  BlockPool small_blocks_{true};
  PointerMap allocated_;  // allocated blocks by address
  NodeArena block_arena_;

  std::vector<std::pair<MempoolId, std::function<bool(StreamId)>>> captures_underway_;
  std::map<MempoolId, std::unique_ptr<PrivatePool>> graph_pools_;
  std::map<MempoolId, PrivatePool*> graph_pools_freeable_;
  std::vector<MempoolId> use_on_oom_pools_;
  std::vector<Block*> needs_events_deferred_until_no_capture_;
  std::unordered_map<Block*, std::vector<StreamId>> block_to_capture_stream_uses_;
  std::shared_ptr<CaptureGraphs> capture_graphs_;
  // Of the blocks in needs_events_deferred_until_no_capture_, those whose last uses the
  // capture's graph knows: the nodes that used them last, on every stream they were used on.
  std::unordered_map<Block*, std::vector<std::uintptr_t>> freed_in_capture_;
  // Outstanding events per stream, oldest first, so one slow stream does not hold up others.
  std::map<StreamId, std::deque<std::pair<EventId, Block*>>> events_;

  std::size_t total_allocated_memory_ = 0;  // reserved bytes, as the fraction check sees them
  // workspace_room's last answer from the device: its free memory, when, and this allocator's
  // reserved bytes then.
  struct DeviceFreeAsked {
    bool known = false;
    std::chrono::steady_clock::time_point at;
    std::size_t free = 0;
    std::int64_t reserved = 0;
  } device_free_asked_;
  // What the page policy remembers between growths (page_policy.h).
  PagePolicy page_policy_;
  // The general large pool's segments alias their pages (Note [aliased pages]): alias_pages,
  // or alias_pages_under_limit with a limit set when its first segment was made.
  bool alias_under_limit_ = false;
  bool aliasing() const { return config_.alias_pages || alias_under_limit_; }
  // The run of free and unmapped blocks the growth being served will occupy: no donor of its
  // pages (a free block inside the run is part of the request, and one whose pages moved
  // cannot be mapped again before they are unmapped).
  Range growing_ {};
  // align_to_pages: the growth being made maps single pages only (map_block clears it where it
  // chunks), so the block it serves starts at a page boundary where that costs no page.
  bool grown_in_single_pages_ = false;
  std::size_t allowed_memory_maximum_ = 0;
  bool set_fraction_ = false;
  std::size_t device_total_ = 0;
  // The physical allocations the general large pool's segments share with aliased pages, by
  // page size (declared first: destroyed after the segments).
  std::map<std::size_t, std::unique_ptr<PhysicalPages>> shared_physical_;
  std::vector<std::unique_ptr<ExpandableSegment>> expandable_segments_;
  // Each live segment's registration counter, by its base address (SegmentInfo).
  std::unordered_map<std::uintptr_t, std::int32_t> registration_;
  std::int32_t next_registration_ = 0;
  std::vector<SparePhysical> spare_pages_;  // taken back, about to be mapped elsewhere
  // Pages moved away and still mapped at their old place, oldest first, each with the events
  // after which the device no longer uses them there (Note [moving pages]).
  struct PageMove {
    std::vector<Block*> blocks;       // the old places (unmap_pending)
    std::vector<Range> still_mapped;  // what to unmap there
    std::vector<EventId> events;      // not yet seen complete
    std::uint64_t unmap_ticket = 0;   // handed to unmapper_ (0: not yet)
  };
  std::deque<PageMove> page_moves_;
  TraceRing trace_;
};

// The allocator's lock for the methods that may release a pool's segments or ask its allocator
// for one (Note [pool allocators outside the lock]): the work queued under it runs after it is
// let go.
class CachingAllocator::Lock {
 public:
  explicit Lock(CachingAllocator& a) : a_(a), lock_(a.mutex_) {}
  ~Lock() {
    if (a_.outside_.empty()) return;  // the usual case: lock_ lets go, nothing else
    std::vector<OutsideWork> work;
    work.swap(a_.outside_);
    lock_.unlock();
    run(std::move(work));
  }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

  // Lets go of the lock, runs the queued work, then `then`, and takes the lock again (also
  // where `then` throws).
  template <typename Then>
  void outside(Then&& then) {
    std::vector<OutsideWork> work;
    work.swap(a_.outside_);
    lock_.unlock();
    struct Relock {
      std::unique_lock<std::mutex>& lock;
      ~Relock() { lock.lock(); }
    } relock{lock_};
    run(std::move(work));
    then();
  }

 private:
  // The frees first, in the order queued; then the references, so that an allocator whose
  // pool is gone is destroyed here too, outside the lock. A pool's allocator reports its own
  // failures (the native back end warns, naming it) and never throws; one that does loses
  // that segment, as a failed free would, and the others are still freed.
  static void run(std::vector<OutsideWork>&& work) noexcept {
    for (OutsideWork& w : work) {
      if (w.ptr == nullptr) continue;
      try {
        w.from->free(w.ptr, w.size);
      } catch (...) {
      }
    }
    work.clear();
  }

  CachingAllocator& a_;
  std::unique_lock<std::mutex> lock_;
};

}  // namespace allocwatch
