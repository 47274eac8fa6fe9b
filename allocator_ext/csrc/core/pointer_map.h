// Allocated blocks by address: an open-addressing hash map with linear probing.
// free() looks up every pointer, so this sits on the hot path; std::unordered_map would
// allocate a node per insert and chase a pointer per lookup.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace allocwatch {

struct Block;

class PointerMap {
 public:
  PointerMap() : slots_(64) {}

  Block* find(std::uintptr_t key) const {
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  void insert(std::uintptr_t key, Block* value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    place(key, value);
    ++size_;
  }

  // Removes `key` and returns its block (nullptr if absent). Backward-shift deletion keeps
  // probe chains intact without tombstones.
  Block* erase(std::uintptr_t key) {
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return nullptr;
      i = (i + 1) & mask();
    }
    Block* value = slots_[i].value;
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask(); slots_[j].key != 0; j = (j + 1) & mask()) {
      std::size_t h = home(slots_[j].key);
      // Move j into the hole if its home lies cyclically outside (hole, j].
      bool movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return value;
  }

  std::size_t size() const { return size_; }

  template <typename F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.key != 0) f(s.value);
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    Block* value = nullptr;
  };
  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t home(std::uintptr_t key) const {
    // Blocks are 512-byte aligned: drop those bits, then mix (Fibonacci hashing).
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void place(std::uintptr_t key, Block* value) {
    std::size_t i = home(key);
    while (slots_[i].key != 0) i = (i + 1) & mask();
    slots_[i] = Slot{key, value};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != 0) place(s.key, s.value);
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace allocwatch
