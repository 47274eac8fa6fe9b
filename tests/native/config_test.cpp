// The settings parser on its own (core/config.cpp), where the Python binding is not in the way:
// whitespace as PyTorch's lexer takes it around ',' ':' '[' ']', and refused inside a word.
// Built and run by tests/core/test_core_config.py; prints one line per check and exits non-zero
// at the first that fails.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "expect.h"

using allocwatch::AllocatorConfig;
using allocwatch::apply_config;
using allocwatch::ConfigError;

using allocwatch_tests::expect;

namespace {

AllocatorConfig parse(const std::string& text) {
  return apply_config(AllocatorConfig::native(), text);
}

// The message `text` is refused with; "" where it is accepted.
std::string refusal(const std::string& text) {
  try {
    parse(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void accepted_as(const std::string& text, const std::string& same_as) {
  const std::string why = refusal(text);
  expect(why.empty() && parse(text) == parse(same_as),
         "'" + text + "' reads as '" + same_as + "'" +
             (why.empty() ? "" : " (refused: " + why + ")"));
}

void refused_naming(const std::string& text, const std::string& message) {
  const std::string why = refusal(text);
  expect(why == message, "'" + text + "' is refused with: " + message +
                             (why == message ? "" : " (got: " + why + ")"));
}

}  // namespace

int main() {
  // Whitespace around the separators: PyTorch's lexer drops it, and so does this one.
  accepted_as("max_split_size_mb: 128", "max_split_size_mb:128");
  accepted_as(" expandable_segments : True ,\tgarbage_collection_threshold:0.6\n",
              "expandable_segments:True,garbage_collection_threshold:0.6");
  accepted_as("roundup_power2_divisions:[ 256:1, 512 : 2, >:4 ]",
              "roundup_power2_divisions:[256:1,512:2,>:4]");
  accepted_as("native , max_split_size_mb:\r\v\f256", "native,max_split_size_mb:256");

  // Whitespace between two characters of one word: PyTorch glues them; refused, naming the key.
  const std::string hint = "' (settings are separated by ',')";
  refused_naming("expandable_segments:True garbage_collection_threshold:0.6",
                 "invalid allocator setting expandable_segments: a space between 'True' and "
                 "'garbage_collection_threshold" + hint);
  refused_naming("garbage_collection_threshold:0.6,max_split_size_mb:1 28",
                 "invalid allocator setting max_split_size_mb: a space between '1' and '28" + hint);
  refused_naming("max_split _size_mb:128",
                 "invalid allocator setting max_split: a space between 'max_split' and '_size_mb" +
                     hint);
  refused_naming("roundup_power2_divisions:[256:1,5 12:2]",
                 "invalid allocator setting roundup_power2_divisions: a space between '5' and '12" +
                     hint);
  refused_naming("native expandable_segments:True",
                 "invalid allocator setting native: a space between 'native' and "
                 "'expandable_segments" + hint);

  // A refused string changes nothing: the base comes back whole from a later, good string.
  const AllocatorConfig before = parse("expandable_segments:True");
  try {
    apply_config(before, "max_split_size_mb:512 expandable_segments:False");
    expect(false, "a space inside a word is refused on top of a base too");
  } catch (const ConfigError&) {
    expect(before == parse("expandable_segments:True"), "a refused string leaves its base alone");
  }

  // The split of a PyTorch string into the keys this allocator knows and the others (the
  // native back end's path for torch.cuda.memory._set_allocator_settings) lexes the same way.
  std::vector<std::pair<std::string, std::string>> others;
  expect(allocwatch::known_settings("per_process_memory_fraction: 0.5, max_split_size_mb : 64",
                                    &others) == "max_split_size_mb:64" &&
             others.size() == 1 && others[0].first == "per_process_memory_fraction" &&
             others[0].second == "0.5",
         "known_settings drops whitespace around separators");
  try {
    allocwatch::known_settings("per_process_memory_fraction:0.5 max_split_size_mb:64", &others);
    expect(false, "known_settings refuses a space inside a word");
  } catch (const ConfigError& e) {
    expect(std::string(e.what()).find("per_process_memory_fraction: a space between '0.5' and "
                                      "'max_split_size_mb'") != std::string::npos,
           "known_settings refuses a space inside a word, naming the key");
  }
  return 0;
}
