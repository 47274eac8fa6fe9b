// The C++ checks' one assertion, for the tests that tests/core compiles on their own
// (page_policy_test.cpp, sim_device_test.cpp, config_test.cpp): one line per check, "ok  " or
// "FAIL" and what it checks, and the process exits non-zero at the first that fails.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace allocwatch_tests {

inline int checks = 0;  // passed so far

inline void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) std::exit(1);
  ++checks;
}

}  // namespace allocwatch_tests
