// Allocator settings in the syntax of PYTORCH_CUDA_ALLOC_CONF.
//
//   "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:512"
//   "native"                              PyTorch's defaults
//   "native,expandable_segments:True"     PyTorch's defaults, then the keys that follow
//
// Every key is a row of settings_table.h. allocwatch's own updates (apply_config: set_config,
// `allocwatch ctl set`) change only the keys they name; torch.cuda.memory._set_allocator_settings
// takes PyTorch's semantics (apply_pytorch_settings). A bad key or value throws ConfigError
// naming it, and the settings passed in are left untouched: parse into a copy, then swap.
#pragma once

#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "settings_table.h"
#include "sizes.h"

namespace allocwatch {

class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Every setting in force, one member per row of ALLOCWATCH_SETTINGS (settings_table.h), each
// starting at PyTorch's default.
struct AllocatorConfig {
#define ALLOCWATCH_SETTING_MEMBER(Type, field, key, range, native_default, allocwatch_default, \
                                  origin, on_pytorch_call, help)                               \
  Type field = native_default;
  ALLOCWATCH_SETTINGS(ALLOCWATCH_SETTING_MEMBER)
#undef ALLOCWATCH_SETTING_MEMBER

  static AllocatorConfig native();     // PyTorch's defaults
  static AllocatorConfig allocwatch();  // allocwatch's defaults (chosen by the measures)

  bool operator==(const AllocatorConfig& other) const;

  // The settings as a string that parses back to them: "native" plus every key that differs
  // from PyTorch's defaults.
  std::string to_string() const;
  // Every key with its value as a settings string writes it, in the table's order.
  std::vector<std::pair<std::string, std::string>> items() const;
};

// Applies `text` on top of `base` and returns the result; throws ConfigError.
AllocatorConfig apply_config(const AllocatorConfig& base, const std::string& text);

// torch.cuda.memory._set_allocator_settings(text) as PyTorch's parser takes it: every setting
// the text does not name and whose row says OnPytorchCall::resets returns to PyTorch's default,
// then `text` applies; throws ConfigError, changing nothing.
AllocatorConfig apply_pytorch_settings(const AllocatorConfig& current, const std::string& text);

// A row's allowed values in words ("a multiple of 2 MiB, at least 2, or 0 (off)"), for the
// docs and the binding's table.
std::string describe_values(const SettingInfo& setting);

// Splits a PyTorch settings string (PYTORCH_CUDA_ALLOC_CONF, _set_allocator_settings) into the
// entries this allocator knows, returned as a settings string, and the others ("key" and its
// value as written, lists included), which steer parts of PyTorch it does not replace
// (pinned memory, graph capture) or are PyTorch's own (per_process_memory_fraction). Only a
// space inside a word is refused here (ConfigError naming the key); apply_config validates.
std::string known_settings(const std::string& text,
                           std::vector<std::pair<std::string, std::string>>* others);

}  // namespace allocwatch
