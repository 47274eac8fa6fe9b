// A string builder with stream syntax, for error messages and settings strings.
//
// The core avoids <sstream>: where an extension links libstdc++ statically (some build
// environments do), its stream and locale machinery can clash with the process's own
// libstdc++, and a message built with std::ostringstream crashed the import on one such
// machine. snprintf and std::to_string need no locale.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace allocwatch {

class Text {
 public:
  Text& operator<<(const std::string& s) {
    out_ += s;
    return *this;
  }
  Text& operator<<(const char* s) {
    out_ += s;
    return *this;
  }
  Text& operator<<(char c) {
    out_ += c;
    return *this;
  }
  Text& operator<<(const void* p) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    out_ += buf;
    return *this;
  }
  Text& operator<<(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    out_ += buf;
    return *this;
  }
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  Text& operator<<(T v) {
    out_ += std::to_string(v);
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

}  // namespace allocwatch
