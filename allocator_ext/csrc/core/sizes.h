// Size classes: how a request is rounded, which pool serves it, and how large a segment the
// device is asked for. These rules are PyTorch's (c10/cuda/CUDACachingAllocator.cpp); a replay
// reproduces PyTorch's reserved memory only if they match to the byte.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace allocwatch {

constexpr std::size_t kMiB = 1024 * 1024;
// Every block is a multiple of 512 bytes, so that tensors stay aligned for vector loads.
constexpr std::size_t kMinBlockSize = 512;
// Requests up to 1 MiB share 2 MiB segments (the small pool): many tiny tensors, few segments.
constexpr std::size_t kSmallSize = 1 * kMiB;
constexpr std::size_t kSmallBuffer = 2 * kMiB;
// Requests between 1 MiB and 10 MiB are carved from 20 MiB segments, so that mid-sized tensors
// of slightly different sizes can share a segment instead of each costing a cudaMalloc.
constexpr std::size_t kMinLargeAlloc = 10 * kMiB;
constexpr std::size_t kLargeBuffer = 20 * kMiB;
// Larger requests get a segment of their own size rounded up to 2 MiB (the driver's page).
constexpr std::size_t kRoundLarge = 2 * kMiB;

// roundup_power2_divisions: one entry per power-of-two interval from 1 MiB to 64 GiB.
constexpr std::size_t kRoundupIntervals = 16;
using RoundupDivisions = std::array<std::size_t, kRoundupIntervals>;

inline int floor_log2(std::size_t v) { return 63 - __builtin_clzll(v); }
inline bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// The number of divisions that applies to a request of `size` bytes.
inline std::size_t divisions_for(std::size_t size, const RoundupDivisions& divisions) {
  int index = floor_log2(size) - floor_log2(kMiB);
  if (index < 0) index = 0;
  if (index >= static_cast<int>(kRoundupIntervals)) index = kRoundupIntervals - 1;
  return divisions[static_cast<std::size_t>(index)];
}

// Rounds up to the next of `divisions` equal steps between two powers of two (1200 with 4
// divisions: the steps between 1024 and 2048 are 1280, 1536, 1792, so 1280). Fewer distinct
// sizes means cached blocks fit later requests more often.
inline std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) {
  if (is_power_of_two(size)) return size;
  std::size_t floor = std::size_t{1} << floor_log2(size);
  std::size_t step = floor >> floor_log2(divisions);
  if (step == 0) return floor << 1;
  std::size_t rounded_down = size & ~(step - 1);
  return rounded_down == size ? size : rounded_down + step;
}

// The largest request served: 8 EiB, far beyond any device. Above it the rounding here and the
// segment's below could wrap past 2**64 to a small size, serving a huge request with a tiny
// block; such a request is refused instead (in PyTorch it could only come from raw_alloc).
constexpr std::size_t kMaxRequest = std::size_t{1} << 63;

inline std::size_t round_size(std::size_t size, const RoundupDivisions& divisions) {
  if (size > kMaxRequest)
    throw std::invalid_argument("allocwatch: a request of " + std::to_string(size) +
                                " bytes is larger than any device (at most 2**63 bytes)");
  if (size < kMinBlockSize) return kMinBlockSize;
  std::size_t d = divisions_for(size, divisions);
  if (d > 1 && size > kMinBlockSize * d) return roundup_power2_next_division(size, d);
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

inline bool is_small_request(std::size_t rounded) { return rounded <= kSmallSize; }

// The size of a new (non-expandable) segment for a rounded request.
inline std::size_t segment_size_for(std::size_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
}

}  // namespace allocwatch
