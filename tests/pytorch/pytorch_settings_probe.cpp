// PyTorch's own settings parser (c10::CachingAllocator::AcceleratorAllocatorConfig, in libc10,
// which CPU builds of torch have too), for tests/pytorch/test_pytorch_settings_parser.py: each
// line of stdin is handed to it as torch.cuda.memory._set_allocator_settings hands it, and one
// line of JSON comes back: the settings it then holds, under allocwatch's key names and written
// as allocwatch's items() writes them, or the error it raised.
#include <c10/core/AllocatorConfig.h>

#include <cstdio>
#include <iostream>
#include <limits>
#include <string>

namespace {

using c10::CachingAllocator::AcceleratorAllocatorConfig;
constexpr std::size_t kMiB = 1024 * 1024;

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (static_cast<unsigned char>(c) < 0x20 ? ' ' : c);  // newlines of a backtrace
  }
  return out + "\"";
}

std::string flag(bool v) { return v ? "\"True\"" : "\"False\""; }

std::string settings() {
  const std::size_t split = AcceleratorAllocatorConfig::max_split_size();
  char gc[32];
  std::snprintf(gc, sizeof gc, "%.17g", AcceleratorAllocatorConfig::garbage_collection_threshold());
  std::string divisions = "[";
  const auto& d = AcceleratorAllocatorConfig::roundup_power2_divisions();
  for (std::size_t i = 0; i < d.size(); ++i)
    divisions += (i ? "," : "") + std::to_string(std::size_t{1} << i) + ":" + std::to_string(d[i]);
  divisions += "]";
  return "{\"max_split_size_mb\": " +
         quoted(split == std::numeric_limits<std::size_t>::max() ? "unlimited"
                                                                 : std::to_string(split / kMiB)) +
         ", \"max_non_split_rounding_mb\": " +
         quoted(std::to_string(AcceleratorAllocatorConfig::max_non_split_rounding_size() / kMiB)) +
         ", \"garbage_collection_threshold\": " + quoted(gc) +
         ", \"expandable_segments\": " + flag(AcceleratorAllocatorConfig::use_expandable_segments()) +
         ", \"roundup_power2_divisions\": " + quoted(divisions) +
         ", \"pinned_use_background_threads\": " +
         flag(AcceleratorAllocatorConfig::pinned_use_background_threads()) + "}";
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    try {
      c10::CachingAllocator::setAllocatorSettings(line);
      std::cout << "{\"settings\": " << settings() << "}" << std::endl;
    } catch (const std::exception& e) {
      std::cout << "{\"error\": " << quoted(e.what()) << ", \"settings\": " << settings() << "}"
                << std::endl;
    }
  }
  return 0;
}
