#include "physical_pages.h"

#include <algorithm>
#include <cassert>

namespace allocwatch {

PhysicalPages::Physical* PhysicalPages::add_address(PhysicalHandle h, std::size_t pages,
                                                    Address a) {
  auto [it, created] = physical_.try_emplace(h);
  it->second.addresses.push_back(a);
  if (created) {
    it->second.handle = h;
    it->second.pages = pages;
    it->second.page.resize(pages);
    physical_bytes_ += pages * page_size_;
    if (pages > 1) ++chunks_;
    idle_bytes_ += pages * page_size_;
    link_idle(&it->second);
  }
  return &it->second;
}

bool PhysicalPages::drop_address(PhysicalHandle h, Address a) {
  auto it = physical_.find(h);
  if (it == physical_.end()) return true;
  auto& addresses = it->second.addresses;
  addresses.erase(std::remove(addresses.begin(), addresses.end(), a), addresses.end());
  if (!addresses.empty()) return false;
  // Only free addresses are unmapped: an allocation without addresses is idle.
  physical_bytes_ -= it->second.pages * page_size_;
  if (it->second.pages > 1) --chunks_;
  idle_bytes_ -= it->second.pages * page_size_;
  unlink_idle(&it->second);
  physical_.erase(it);
  return true;
}

void PhysicalPages::use(Physical& p, std::size_t i, Address a, int delta) {
  Page& page = p.page[i];
  const bool was_idle = p.idle();
  const bool page_was_free = page.in_use == 0;
  page.in_use += delta;
  page.at = page.in_use > 0 ? a : Address{};
  if (page_was_free && page.in_use > 0) ++p.pages_in_use;
  if (!page_was_free && page.in_use == 0) --p.pages_in_use;
  if (was_idle && !p.idle()) {
    idle_bytes_ -= p.pages * page_size_;
    unlink_idle(&p);
  }
  if (!was_idle && p.idle()) {
    idle_bytes_ += p.pages * page_size_;
    link_idle(&p);
  }
}

std::vector<PhysicalPages::Address> PhysicalPages::forget(PhysicalHandle h) {
  auto it = physical_.find(h);
  assert(it != physical_.end() && it->second.idle());
  std::vector<Address> addresses = std::move(it->second.addresses);
  physical_bytes_ -= it->second.pages * page_size_;
  if (it->second.pages > 1) --chunks_;
  idle_bytes_ -= it->second.pages * page_size_;
  unlink_idle(&it->second);
  physical_.erase(it);
  return addresses;
}

void PhysicalPages::link_idle(Physical* p) {
  p->idle_prev = nullptr;
  p->idle_next = idle_head_;
  if (idle_head_ != nullptr) idle_head_->idle_prev = p;
  idle_head_ = p;
}

void PhysicalPages::unlink_idle(Physical* p) {
  (p->idle_prev != nullptr ? p->idle_prev->idle_next : idle_head_) = p->idle_next;
  if (p->idle_next != nullptr) p->idle_next->idle_prev = p->idle_prev;
  p->idle_prev = p->idle_next = nullptr;
}

std::string PhysicalPages::check(const InUseCounts& in_use_by_address) const {
  std::size_t idle = 0, physical = 0;
  for (const auto& [handle, p] : physical_) {
    std::size_t pages_in_use = 0;
    for (std::size_t i = 0; i < p.pages; ++i) {
      const Page& page = p.page[i];
      int addresses_in_use = 0, total = 0;
      Address at;
      for (const Address& a : p.addresses) {
        auto it = in_use_by_address.find({a.segment, a.first + i});
        const int n = it == in_use_by_address.end() ? 0 : it->second;
        if ((page.in_use > 0 && a == page.at ? page.in_use : 0) != n)
          return "an address's count of blocks in use is wrong";
        if (n > 0) ++addresses_in_use, at = a;
        total += n;
      }
      if (addresses_in_use > 1) return "a physical page is in use through two addresses";
      if (page.in_use != total || (total > 0 && !(page.at == at)))
        return "a physical page's count of blocks in use is wrong";
      if (total > 0) ++pages_in_use;
    }
    if (pages_in_use != p.pages_in_use)
      return "a physical allocation's count of pages in use is wrong";
    if (pages_in_use == 0) idle += p.pages * page_size_;
    physical += p.pages * page_size_;
  }
  if (idle != idle_bytes_) return "the idle bytes of physical memory disagree with a recount";
  if (physical != physical_bytes_) return "the physical bytes disagree with a recount";
  std::size_t listed = 0;
  for (const Physical* p = idle_head_; p != nullptr; p = p->idle_next) {
    if (!p->idle()) return "a physical allocation in use is listed as idle";
    listed += p->pages * page_size_;
  }
  if (listed != idle_bytes_) return "the list of idle physical allocations is incomplete";
  return "";
}

}  // namespace allocwatch
