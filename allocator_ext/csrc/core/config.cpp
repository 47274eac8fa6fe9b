#include "config.h"

#include "text.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace allocwatch {

namespace {

// Splits like PyTorch's lexer: ',' ':' '[' ']' are tokens of their own; spaces are dropped.
std::vector<std::string> lex(const std::string& text) {
  std::vector<std::string> tokens;
  std::string word;
  for (char c : text) {
    if (c == ',' || c == ':' || c == '[' || c == ']') {
      if (!word.empty()) tokens.push_back(std::move(word)), word.clear();
      tokens.emplace_back(1, c);
    } else if (c != ' ' && c != '\t' && c != '\n') {
      word.push_back(c);
    }
  }
  if (!word.empty()) tokens.push_back(std::move(word));
  return tokens;
}

[[noreturn]] void fail(const std::string& key, const std::string& value, const std::string& why) {
  Text msg;
  msg << "invalid allocator setting " << key;
  if (!value.empty()) msg << ":" << value;
  msg << ": " << why;
  throw ConfigError(msg.str());
}

// An error in the string as a whole (not one key's): the string itself is what to show.
[[noreturn]] void fail_text(const std::string& text, const std::string& why) {
  Text msg;
  msg << "invalid allocator settings '" << text << "': " << why;
  throw ConfigError(msg.str());
}

// Strict unsigned parse: digits only (PyTorch's stoi accepts "12abc"; a typo should not pass).
std::size_t parse_count(const std::string& key, const std::string& value) {
  if (value.empty() || !std::all_of(value.begin(), value.end(), ::isdigit))
    fail(key, value, "expected a non-negative whole number");
  errno = 0;
  unsigned long long v = std::strtoull(value.c_str(), nullptr, 10);
  if (errno == ERANGE) fail(key, value, "number too large");
  return static_cast<std::size_t>(v);
}

double parse_real(const std::string& key, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size() || errno == ERANGE || !std::isfinite(v))
    fail(key, value, "expected a number");
  return v;
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  fail(key, value, "expected True or False");
}

std::size_t parse_megabytes(const std::string& key, const std::string& value, std::size_t min_mb) {
  std::size_t mb = parse_count(key, value);
  if (mb < min_mb) fail(key, value, "must be at least " + std::to_string(min_mb) + " (MiB)");
  if (mb > kNoMaxSplit / kMiB) fail(key, value, "number too large");
  return mb * kMiB;
}

std::string bool_text(bool v) { return v ? "True" : "False"; }

std::string real_text(double v) {
  Text s;
  s << v;
  return s.str();
}

// Cursor over the token stream of one settings string.
class Tokens {
 public:
  explicit Tokens(std::vector<std::string> t) : t_(std::move(t)) {}
  bool done() const { return i_ >= t_.size(); }
  const std::string& peek() const { return t_[i_]; }
  std::string take(const std::string& key, const char* what) {
    if (done()) fail(key, "", std::string("missing ") + what);
    return t_[i_++];
  }
  void expect(const std::string& key, const std::string& token) {
    std::string got = take(key, ("'" + token + "'").c_str());
    if (got != token) fail(key, got, "expected '" + token + "'");
  }

 private:
  std::vector<std::string> t_;
  std::size_t i_ = 0;
};

void parse_roundup(Tokens& tok, AllocatorConfig& cfg) {
  const std::string key = "roundup_power2_divisions";
  std::string first = tok.take(key, "value");
  auto divisions_value = [&](const std::string& v) {
    std::size_t d = parse_count(key, v);
    if (d != 0 && !is_power_of_two(d)) fail(key, v, "divisions must be a power of two, or 0");
    return d;
  };
  if (first != "[") {
    std::size_t d = divisions_value(first);
    if (d == 0) fail(key, first, "divisions must be a power of two");
    cfg.roundup_power2_divisions.fill(d);
    return;
  }
  // [256:1,512:2,>:4] — interval start in MiB : divisions; '>' applies to all later intervals.
  RoundupDivisions result = cfg.roundup_power2_divisions;
  bool first_value = true;
  std::size_t last_index = 0;
  while (true) {
    std::string interval = tok.take(key, "']'");
    if (interval == "]") break;
    tok.expect(key, ":");
    std::size_t d = divisions_value(tok.take(key, "divisions"));
    if (interval == ">") {
      std::fill(result.begin() + static_cast<long>(last_index), result.end(), d);
    } else {
      std::size_t mb = parse_count(key, interval);
      if (!is_power_of_two(mb)) fail(key, interval, "interval sizes must be powers of two (MiB)");
      std::size_t index = std::min<std::size_t>(floor_log2(mb), kRoundupIntervals - 1);
      if (first_value) {
        std::fill(result.begin(), result.begin() + static_cast<long>(index), d);
        first_value = false;
      }
      result[index] = d;
      last_index = index;
    }
    if (!tok.done() && tok.peek() == ",") tok.take(key, ",");
  }
  cfg.roundup_power2_divisions = result;
}

void apply_key(const std::string& key, Tokens& tok, AllocatorConfig& cfg) {
  if (key == "roundup_power2_divisions") {
    tok.expect(key, ":");
    parse_roundup(tok, cfg);
    return;
  }
  tok.expect(key, ":");
  std::string value = tok.take(key, "value");
  if (key == "max_split_size_mb") {
    cfg.max_split_size = parse_megabytes(key, value, kLargeBuffer / kMiB);
  } else if (key == "max_non_split_rounding_mb") {
    cfg.max_non_split_rounding = parse_megabytes(key, value, kLargeBuffer / kMiB);
  } else if (key == "garbage_collection_threshold") {
    double v = parse_real(key, value);
    if (!(v > 0.0 && v < 1.0)) fail(key, value, "must lie strictly between 0 and 1");
    cfg.garbage_collection_threshold = v;
  } else if (key == "expandable_segments") {
    cfg.expandable_segments = parse_bool(key, value);
  } else if (key == "backend") {
    if (value != "native")
      fail(key, value,
           "allocwatch replaces PyTorch's native allocator only; leave backend unset or "
           "native (to keep cudaMallocAsync, run without allocwatch's allocator)");
  } else if (key == "release_lock_on_cudamalloc") {
    cfg.release_lock_on_cudamalloc = parse_bool(key, value);
  } else if (key == "pinned_use_cuda_host_register") {
    cfg.pinned_use_cuda_host_register = parse_bool(key, value);
  } else if (key == "pinned_num_register_threads") {
    std::size_t n = parse_count(key, value);
    if (!is_power_of_two(n) || n > 128) fail(key, value, "must be a power of two up to 128");
    cfg.pinned_num_register_threads = n;
  } else if (key == "pinned_use_background_threads") {
    cfg.pinned_use_background_threads = parse_bool(key, value);
  } else if (key == "expandable_large_page_mb") {
    std::size_t bytes = parse_megabytes(key, value, 2);
    if (bytes % kRoundLarge != 0) fail(key, value, "must be a multiple of 2 (MiB)");
    cfg.expandable_large_page = bytes;
  } else if (key == "expandable_grow_mb") {
    std::size_t mb = parse_count(key, value);
    if (mb % 2 != 0) fail(key, value, "must be a multiple of 2 (MiB), or 0");
    if (mb > kNoMaxSplit / kMiB) fail(key, value, "number too large");
    cfg.expandable_grow = mb * kMiB;
  } else if (key == "expandable_chunk_mb") {
    std::size_t mb = parse_count(key, value);
    if (mb % 2 != 0) fail(key, value, "must be a multiple of 2 (MiB), or 0");
    if (mb > kNoMaxSplit / kMiB) fail(key, value, "number too large");
    cfg.expandable_chunk = mb * kMiB;
  } else if (key == "reuse_free_pages") {
    cfg.reuse_free_pages = parse_bool(key, value);
  } else if (key == "settle_page_moves") {
    cfg.settle_page_moves = parse_bool(key, value);
  } else {
    fail(key, "",
         "unknown key (known: max_split_size_mb, max_non_split_rounding_mb, "
         "garbage_collection_threshold, expandable_segments, roundup_power2_divisions, "
         "expandable_large_page_mb, expandable_grow_mb, expandable_chunk_mb, reuse_free_pages, "
         "settle_page_moves, "
         "backend, release_lock_on_cudamalloc, "
         "pinned_use_cuda_host_register, pinned_num_register_threads, "
         "pinned_use_background_threads; preset: native)");
  }
}

}  // namespace

AllocatorConfig AllocatorConfig::native() { return AllocatorConfig{}; }

AllocatorConfig AllocatorConfig::allocwatch() {
  AllocatorConfig cfg;
  cfg.expandable_segments = true;
  // PyTorch's rules with expandable segments, plus allocwatch's page policy: free pages taken
  // back before a segment grows past its high-water mark, a take-back that recurs settled by
  // creating its pages once, 2 MiB large pages created in 10 MiB chunks (expandable.cpp, Note
  // [page policy]). Chosen by the measures of DESIGN.md and of long runs on the recorded
  // traces; the figures are in docs/benchmarks.md.
  cfg.expandable_large_page = 2 * kMiB;
  cfg.expandable_chunk = 10 * kMiB;
  cfg.reuse_free_pages = true;
  cfg.settle_page_moves = true;
  return cfg;
}

bool AllocatorConfig::operator==(const AllocatorConfig& o) const { return items() == o.items(); }

std::vector<std::pair<std::string, std::string>> AllocatorConfig::items() const {
  Text roundup;
  roundup << "[";
  for (std::size_t i = 0; i < kRoundupIntervals; ++i)
    roundup << (i ? "," : "") << (std::size_t{1} << i) << ":" << roundup_power2_divisions[i];
  roundup << "]";
  return {
      {"max_split_size_mb",
       max_split_size == kNoMaxSplit ? "unlimited" : std::to_string(max_split_size / kMiB)},
      {"max_non_split_rounding_mb", std::to_string(max_non_split_rounding / kMiB)},
      {"garbage_collection_threshold", real_text(garbage_collection_threshold)},
      {"expandable_segments", bool_text(expandable_segments)},
      {"roundup_power2_divisions", roundup.str()},
      {"expandable_large_page_mb", std::to_string(expandable_large_page / kMiB)},
      {"expandable_grow_mb", std::to_string(expandable_grow / kMiB)},
      {"expandable_chunk_mb", std::to_string(expandable_chunk / kMiB)},
      {"reuse_free_pages", bool_text(reuse_free_pages)},
      {"settle_page_moves", bool_text(settle_page_moves)},
      {"release_lock_on_cudamalloc", bool_text(release_lock_on_cudamalloc)},
      {"pinned_use_cuda_host_register", bool_text(pinned_use_cuda_host_register)},
      {"pinned_num_register_threads", std::to_string(pinned_num_register_threads)},
      {"pinned_use_background_threads", bool_text(pinned_use_background_threads)},
  };
}

std::string AllocatorConfig::to_string() const {
  auto mine = items();
  auto defaults = native().items();
  std::string out = "native";
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].second == defaults[i].second) continue;
    out += "," + mine[i].first + ":" + mine[i].second;
  }
  return out;
}

std::string known_settings(const std::string& text,
                           std::vector<std::pair<std::string, std::string>>* others) {
  static const char* const kKnown[] = {
      "native", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
      "expandable_segments", "roundup_power2_divisions", "backend",
      "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
      "pinned_num_register_threads", "pinned_use_background_threads",
      "expandable_large_page_mb", "expandable_grow_mb", "expandable_chunk_mb",
      "reuse_free_pages", "settle_page_moves"};
  const std::vector<std::string> tokens = lex(text);
  std::string known;
  for (std::size_t i = 0; i < tokens.size();) {
    if (tokens[i] == ",") {
      ++i;
      continue;
    }
    const std::string key = tokens[i++];
    std::string entry = key, value;
    if (i < tokens.size() && tokens[i] == ":") {
      entry += tokens[i++];
      int depth = 0;
      while (i < tokens.size() && (depth > 0 || tokens[i] != ",")) {
        if (tokens[i] == "[") ++depth;
        if (tokens[i] == "]") --depth;
        value += tokens[i++];
      }
      entry += value;
    }
    const bool is_known = std::any_of(std::begin(kKnown), std::end(kKnown),
                                      [&](const char* k) { return key == k; });
    if (is_known) {
      known += (known.empty() ? "" : ",") + entry;
    } else if (others != nullptr) {
      others->emplace_back(key, value);
    }
  }
  return known;
}

AllocatorConfig apply_config(const AllocatorConfig& base, const std::string& text) {
  AllocatorConfig cfg = base;
  Tokens tok(lex(text));
  bool first = true;
  while (!tok.done()) {
    std::string key = tok.take("settings", "key");
    if (key == ",") fail_text(text, "an empty entry between two ','");
    if (key == "native") {
      if (!first) fail("native", "", "the preset must come first");
      cfg = AllocatorConfig::native();
    } else {
      apply_key(key, tok, cfg);
    }
    first = false;
    if (!tok.done()) {
      std::string sep = tok.take(key, "','");
      if (sep != ",") fail(key, sep, "expected ',' between settings");
      if (tok.done()) fail_text(text, "it ends with ',' (remove it, or add a key:value after it)");
    }
  }
  return cfg;
}

}  // namespace allocwatch
