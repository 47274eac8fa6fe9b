// Physical allocations of expandable segments, each with every address it is mapped at.
//
// A segment owns the registry of its own pages; with aliased pages the segments of the general
// large pool, one per stream, share one, so that a physical allocation in use through none of
// its addresses can be mapped at one more address of any of them (expandable.cpp, Note
// [aliased pages]). Whatever the number of addresses, each page is in use through one of them
// at a time, and an allocation's memory is counted and released once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "device.h"

namespace allocwatch {

class ExpandableSegment;

class PhysicalPages {
 public:
  explicit PhysicalPages(std::size_t page_size) : page_size_(page_size) {}
  PhysicalPages(const PhysicalPages&) = delete;
  PhysicalPages& operator=(const PhysicalPages&) = delete;

  struct Address {
    const ExpandableSegment* segment = nullptr;
    std::size_t first = 0;  // first page, in the segment
    bool operator==(const Address& o) const { return segment == o.segment && first == o.first; }
  };
  // One page of a physical allocation: the blocks in use over it, all through one address,
  // and the stream that last used it (a page of a chunk may serve a block at one address while
  // another page of the same chunk serves one at another: Note [aliased pages], pages of a
  // chunk).
  struct Page {
    int in_use = 0;  // blocks in use over it
    Address at;      // the address they use
    // The stream of the segment it was last handed out through: another stream's use must
    // first wait for that one on the device.
    StreamId last_stream = 0;
    bool handed_out = false;
    bool streams_changed = false;  // it was handed out on two streams once
    // The number its last free there took (HandOff::free_seq): an event of that number or
    // later on last_stream orders after it; 0: none known (a free during a capture).
    std::uint64_t free_seq = 0;
  };
  struct Physical {
    PhysicalHandle handle = 0;
    std::size_t pages = 0;
    std::vector<Address> addresses;
    std::vector<Page> page;        // by page offset
    std::size_t pages_in_use = 0;  // pages with a block in use over them
    mutable std::uint64_t seen = 0;  // ExpandableSegment::usable()'s stamp
    Physical* idle_prev = nullptr;   // the list of those in use through no address
    Physical* idle_next = nullptr;
    bool idle() const { return pages_in_use == 0; }
    // Page i is usable through this address: in use through no other.
    bool free_at(std::size_t i, const Address& a) const {
      return page[i].in_use == 0 || page[i].at == a;
    }
  };

  std::size_t page_size() const { return page_size_; }
  // Adds an address of h (creating its entry at the first); the entry's node stays put.
  Physical* add_address(PhysicalHandle h, std::size_t pages, Address a);
  // True where that was h's last address (its physical memory may go).
  bool drop_address(PhysicalHandle h, Address a);
  // A block over page i of p, through address a, was handed out (+1) or freed (-1).
  void use(Physical& p, std::size_t i, Address a, int delta);
  // Forgets every address of an idle allocation, and returns them (the caller unmaps each).
  std::vector<Address> forget(PhysicalHandle h);

  std::size_t physical_bytes() const { return physical_bytes_; }
  // Physical allocations of more than one page.
  std::size_t chunks() const { return chunks_; }
  // Physical bytes in use through none of their addresses.
  std::size_t idle_bytes() const { return idle_bytes_; }
  const Physical* idle_head() const { return idle_head_; }
  // f(physical allocation) for each, in handle order.
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [handle, p] : physical_) f(p);
  }
  std::uint64_t next_stamp() const { return ++stamp_; }
  // Blocks in use over each page of a segment (segment, page).
  using InUseCounts = std::map<std::pair<const ExpandableSegment*, std::size_t>, int>;
  // The invariant against the blocks in use, given per page of each segment as a count: each
  // physical page's count is that of one of its addresses (through one at a time), and the idle
  // list and bytes are right.
  // Empty where it holds, else what is wrong.
  std::string check(const InUseCounts& in_use_by_address) const;

 private:
  void link_idle(Physical* p);
  void unlink_idle(Physical* p);

  std::size_t page_size_;
  std::map<PhysicalHandle, Physical> physical_;
  Physical* idle_head_ = nullptr;
  std::size_t idle_bytes_ = 0;
  std::size_t physical_bytes_ = 0;
  std::size_t chunks_ = 0;
  mutable std::uint64_t stamp_ = 0;
};

}  // namespace allocwatch
