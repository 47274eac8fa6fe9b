// The page policy's memory: what allocwatch's rules for expandable segments remember between
// growths, and the decisions that depend on nothing else (expandable.cpp, Note [page policy],
// has the rules and why). The allocator owns one and asks it; the block logic stays there.
//
// It remembers three things, as the note says:
// - the high-water mark: the most reserved since the start or the last explicit reclaim
//   (empty_cache, an operator's garbage_collect);
// - the ceiling: a memory fraction, known from the moment it is set, and reserved memory plus
//   what was left when the device last refused growth (forgotten by a new memory fraction);
// - the growths that moved pages, by (stream, request, bytes allocated): a recurring one is a
//   cycle, settled by creating its pages once (settle_page_moves); forgotten by an explicit
//   reclaim.
#pragma once

#include <algorithm>
#include <cstddef>
#include <set>
#include <tuple>

#include "device.h"

namespace allocwatch {

class PagePolicy {
 public:
  // Large-pool growth creates single pages, not chunks, once reserved memory would pass this
  // share of where the device last refused growth.
  static constexpr double kNearRefusal = 0.95;

  // --- the high-water mark ---
  void reserved(std::size_t total) { high_water_ = std::max(high_water_, total); }
  std::size_t high_water() const { return high_water_; }
  // Growing to `reserved_after` raises no peak below the mark: new pages then, no moves.
  bool above_high_water(std::size_t reserved_after) const { return reserved_after > high_water_; }

  // --- the ceiling ---
  // A memory fraction or limit was set: `below_whole_device` says whether it caps anything
  // (a limit below the device's memory is a ceiling from the moment it is set). Either way it
  // forgets where the device refused.
  void limit_set(bool below_whole_device) {
    limited_ = below_whole_device;
    refused_at_ = 0;
  }
  // A memory fraction below the whole device, or a limit, is set.
  bool limited() const { return limited_; }
  // The device refused growth with `ceiling` = reserved memory + what it had left.
  void growth_refused(std::size_t ceiling) { refused_at_ = ceiling; }
  // Large-pool growth to `reserved_after` creates single pages rather than chunks: always
  // under a ceiling set in advance (chunks created on the way up pin their free pages by the
  // time it is near), and near where the device refused.
  bool single_pages(std::size_t reserved_after) const {
    return limited_ ||
           (refused_at_ > 0 &&
            static_cast<double>(reserved_after) > kNearRefusal * static_cast<double>(refused_at_));
  }
  // Reserved memory passed where the device refused after all (another process freed
  // memory): forget that refusal.
  void mapped(std::size_t reserved_now) {
    if (reserved_now > refused_at_) refused_at_ = 0;
  }

  // --- growths that moved pages ---
  // A growth starts: the request of `size` bytes on `stream` with `allocated` bytes in use.
  void begin_growth(StreamId stream, std::size_t size, std::size_t allocated) {
    growth_ = Growth{stream, size, allocated};
    growth_moved_pages_ = false;
  }
  // This growth moved pages at an earlier recurrence.
  bool growth_moved_before() const { return moved_.count(growth_) > 0; }
  // About to move pages for the current growth: true where that repeats an earlier move of the
  // same growth (a cycle: create the pages instead). Two calls for one growth count as one.
  bool repeats_page_move() {
    if (growth_moved_pages_) return false;
    if (!moved_.insert(growth_).second) return true;
    growth_moved_pages_ = true;
    return false;
  }

  // An explicit reclaim asked for less memory from now on: the mark drops to what is left,
  // and the growths seen are forgotten.
  void reclaimed(std::size_t reserved_now) {
    high_water_ = reserved_now;
    moved_.clear();
  }

 private:
  using Growth = std::tuple<StreamId, std::size_t, std::size_t>;
  std::size_t high_water_ = 0;
  bool limited_ = false;        // a memory fraction below the whole device, or a limit
  std::size_t refused_at_ = 0;  // reserved + what the device had left at its last refusal
  std::set<Growth> moved_;
  Growth growth_{};
  bool growth_moved_pages_ = false;
};

}  // namespace allocwatch
