#include "config.h"

#include "text.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>

namespace allocwatch {

namespace {

[[noreturn]] void fail(const std::string& key, const std::string& value, const std::string& why);

bool is_separator(char c) { return c == ',' || c == ':' || c == '[' || c == ']'; }
bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

// Splits like PyTorch's lexer: ',' ':' '[' ']' are tokens of their own, and whitespace around
// them is dropped. Whitespace between two characters of one word is refused, naming the entry's
// key: PyTorch glues the two, so a ',' forgotten in "expandable_segments:True
// max_split_size_mb:512" gives expandable_segments the value "Truemax_split_size_mb", and
// "max_split_size_mb:1 28" would read as 128.
std::vector<std::string> lex(const std::string& text) {
  std::vector<std::string> tokens;
  std::string word, key;  // key: the first word of the entry being read
  bool space_in_word = false;
  int depth = 0;  // inside '[' ']' a ',' separates list items, not entries
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (is_separator(c)) {
      if (key.empty() && !word.empty()) key = word;
      if (!word.empty()) tokens.push_back(std::move(word)), word.clear();
      tokens.emplace_back(1, c);
      if (c == '[') ++depth;
      if (c == ']' && depth > 0) --depth;
      if (c == ',' && depth == 0) key.clear();
      space_in_word = false;
    } else if (is_space(c)) {
      space_in_word = !word.empty();
    } else {
      if (space_in_word) {
        std::size_t end = i;
        while (end < text.size() && !is_separator(text[end]) && !is_space(text[end])) ++end;
        fail(key.empty() ? word : key, "",
             "a space between '" + word + "' and '" + text.substr(i, end - i) +
                 "' (settings are separated by ',')");
      }
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

// The shortest text that reads back as exactly `v` (0.8, not 0.80000000000000004).
std::string real_text(double v) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
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

void parse_roundup(const std::string& key, Tokens& tok, RoundupDivisions& out) {
  std::string first = tok.take(key, "value");
  auto divisions_value = [&](const std::string& v) {
    std::size_t d = parse_count(key, v);
    if (d != 0 && !is_power_of_two(d)) fail(key, v, "divisions must be a power of two, or 0");
    return d;
  };
  if (first != "[") {
    std::size_t d = divisions_value(first);
    if (d == 0) fail(key, first, "divisions must be a power of two");
    out.fill(d);
    return;
  }
  // [256:1,512:2,>:4] — interval start in MiB : divisions. The intervals before the first one
  // named take its value; '>' applies to every interval after the last one named (PyTorch's
  // parser, which also leaves the first interval alone when '>' comes first).
  RoundupDivisions result = out;
  bool first_value = true;
  std::size_t last_index = 0;
  while (true) {
    std::string interval = tok.take(key, "']'");
    if (interval == "]") break;
    tok.expect(key, ":");
    std::size_t d = divisions_value(tok.take(key, "divisions"));
    if (interval == ">") {
      std::fill(result.begin() + static_cast<long>(std::min(last_index + 1, result.size())),
                result.end(), d);
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
  out = result;
}

// --- reading one value of each type, checked against its row's range ---

void read(const SettingInfo& s, Tokens& tok, bool& out) {
  out = parse_bool(s.key, tok.take(s.key, "value"));
}

void read(const SettingInfo& s, Tokens& tok, std::size_t& out) {
  const ValueRange& r = s.range;
  const std::string value = tok.take(s.key, "value");
  const std::size_t n = parse_count(s.key, value);
  const char* unit = r.in_mebibytes ? " (MiB)" : "";
  const std::string or_zero = r.zero ? ", or 0" : "";
  if (!(n == 0 && r.zero)) {
    if (r.power_of_two && (!is_power_of_two(n) || (r.max != 0 && n > r.max)))
      fail(s.key, value, "must be a power of two up to " + std::to_string(r.max));
    if (r.max != 0 && n > r.max)
      fail(s.key, value, "must be at most " + std::to_string(r.max) + unit);
    if (n < r.min)
      fail(s.key, value, "must be at least " + std::to_string(r.min) + unit + or_zero);
    if (n % r.multiple != 0)
      fail(s.key, value, "must be a multiple of " + std::to_string(r.multiple) + unit + or_zero);
  }
  if (!r.in_mebibytes) {
    out = n;
    return;
  }
  if (n > kNoMaxSplit / kMiB) fail(s.key, value, "number too large");
  out = n * kMiB;
}

void read(const SettingInfo& s, Tokens& tok, double& out) {
  const std::string value = tok.take(s.key, "value");
  const double v = parse_real(s.key, value);
  if (!(v > s.range.above && v < s.range.below))
    fail(s.key, value, "must lie strictly between " + real_text(s.range.above) + " and " +
                           real_text(s.range.below));
  out = v;
}

void read(const SettingInfo& s, Tokens& tok, RoundupDivisions& out) { parse_roundup(s.key, tok, out); }

void read(const SettingInfo& s, Tokens& tok, AllocatorBackend& out) {
  const std::string value = tok.take(s.key, "value");
  if (value != "native")
    fail(s.key, value,
         "allocwatch replaces PyTorch's native allocator only; leave backend unset or "
         "native (to keep cudaMallocAsync, run without allocwatch's allocator)");
  out = AllocatorBackend::native;
}

// --- writing one value of each type, as a settings string takes it back ---

std::string show(const SettingInfo&, bool v) { return v ? "True" : "False"; }

std::string show(const SettingInfo& s, std::size_t v) {
  if (s.range.unlimited && v == kNoMaxSplit) return "unlimited";
  return std::to_string(s.range.in_mebibytes ? v / kMiB : v);
}

std::string show(const SettingInfo&, double v) { return real_text(v); }

std::string show(const SettingInfo&, const RoundupDivisions& v) {
  Text s;
  s << "[";
  for (std::size_t i = 0; i < kRoundupIntervals; ++i)
    s << (i ? "," : "") << (std::size_t{1} << i) << ":" << v[i];
  s << "]";
  return s.str();
}

std::string show(const SettingInfo&, AllocatorBackend) { return "native"; }

// --- each type's allowed values in words ---

std::string describe(const SettingInfo&, const bool*) { return "True or False"; }

std::string describe(const SettingInfo& s, const std::size_t*) {
  const ValueRange& r = s.range;
  std::string text;
  if (r.power_of_two) {
    text = "a power of two";
  } else if (r.multiple > 1) {
    text = "a multiple of " + std::to_string(r.multiple) + (r.in_mebibytes ? " MiB" : "");
  } else {
    text = r.in_mebibytes ? "whole MiB" : "a whole number";
  }
  if (r.min > (r.power_of_two ? 1 : 0)) text += ", at least " + std::to_string(r.min);
  if (r.max != 0) text += ", at most " + std::to_string(r.max);
  if (r.zero) text += ", or 0 (off)";
  return text;
}

std::string describe(const SettingInfo& s, const double*) {
  return "a number strictly between " + real_text(s.range.above) + " and " +
         real_text(s.range.below);
}

std::string describe(const SettingInfo&, const RoundupDivisions*) {
  return "a power of two (or 0 in a list), for every size or per interval: [256:1,512:2,>:4]";
}

std::string describe(const SettingInfo&, const AllocatorBackend*) { return "native"; }

std::string unknown_key_message() {
  std::string known;
  for (const SettingInfo& s : kSettings) known += (known.empty() ? "" : ", ") + std::string(s.key);
  return "unknown key (known: " + known + "; preset: native)";
}

void apply_key(const std::string& key, Tokens& tok, AllocatorConfig& cfg) {
  std::size_t row = 0;
#define ALLOCWATCH_APPLY_KEY(Type, field, name, ...) \
  if (key == name) {                                 \
    tok.expect(key, ":");                            \
    read(kSettings[row], tok, cfg.field);            \
    return;                                          \
  }                                                  \
  ++row;
  ALLOCWATCH_SETTINGS(ALLOCWATCH_APPLY_KEY)
#undef ALLOCWATCH_APPLY_KEY
  fail(key, "", unknown_key_message());
}

}  // namespace

AllocatorConfig AllocatorConfig::native() { return AllocatorConfig{}; }

AllocatorConfig AllocatorConfig::allocwatch() {
  AllocatorConfig cfg;
#define ALLOCWATCH_DEFAULT(Type, field, key, range, native_default, allocwatch_default, ...) \
  cfg.field = allocwatch_default;
  ALLOCWATCH_SETTINGS(ALLOCWATCH_DEFAULT)
#undef ALLOCWATCH_DEFAULT
  return cfg;
}

bool AllocatorConfig::operator==(const AllocatorConfig& o) const { return items() == o.items(); }

std::vector<std::pair<std::string, std::string>> AllocatorConfig::items() const {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(std::size(kSettings));
  std::size_t row = 0;
#define ALLOCWATCH_ITEM(Type, field, key, ...) out.emplace_back(key, show(kSettings[row++], field));
  ALLOCWATCH_SETTINGS(ALLOCWATCH_ITEM)
#undef ALLOCWATCH_ITEM
  return out;
}

std::string describe_values(const SettingInfo& setting) {
  const std::string key = setting.key;
#define ALLOCWATCH_DESCRIBE(Type, field, name, ...) \
  if (key == name) return describe(setting, static_cast<const Type*>(nullptr));
  ALLOCWATCH_SETTINGS(ALLOCWATCH_DESCRIBE)
#undef ALLOCWATCH_DESCRIBE
  return "";
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
    const bool is_known = key == "native" || std::any_of(std::begin(kSettings), std::end(kSettings),
                                                         [&](const SettingInfo& s) {
                                                           return key == s.key;
                                                         });
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

AllocatorConfig apply_pytorch_settings(const AllocatorConfig& current, const std::string& text) {
  AllocatorConfig cfg = current;
  const AllocatorConfig defaults = AllocatorConfig::native();
  std::size_t row = 0;
#define ALLOCWATCH_RESET(Type, field, ...)                              \
  if (kSettings[row++].on_pytorch_call == OnPytorchCall::resets) \
    cfg.field = defaults.field;
  ALLOCWATCH_SETTINGS(ALLOCWATCH_RESET)
#undef ALLOCWATCH_RESET
  return apply_config(cfg, text);
}

}  // namespace allocwatch
