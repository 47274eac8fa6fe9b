// SimDevice's physical memory as the driver keeps it: built and run by
// tests/core/test_sim_device.py; prints one line per check and exits non-zero at the first that
// fails. The replay's capped figures rest on these rules.
#include <cstdio>
#include <cstdlib>

#include "devices/sim_device.h"
#include "expect.h"

using allocwatch::DeviceError;
using allocwatch::PhysicalHandle;
using allocwatch::SimDevice;

using allocwatch_tests::checks;
using allocwatch_tests::expect;

namespace {

template <typename F>
bool refused(F f) {
  try {
    f();
  } catch (const DeviceError&) {
    return true;
  }
  return false;
}

constexpr std::size_t MiB = std::size_t{1} << 20;

}  // namespace

int main() {
  {
    SimDevice dev(30 * MiB);
    PhysicalHandle h = 0;
    expect(dev.create_physical(20 * MiB, &h) && dev.used() == 20 * MiB, "a creation holds memory");
    const std::uintptr_t a = dev.reserve_address(64 * MiB, 2 * MiB);
    dev.map(a, 20 * MiB, h);
    dev.map(a + 32 * MiB, 20 * MiB, h);
    dev.release_physical(h, 20 * MiB);
    expect(dev.used() == 20 * MiB, "released while mapped: the memory stays (cuMemRelease)");
    PhysicalHandle other = 0;
    expect(!dev.create_physical(20 * MiB, &other), "and another creation does not fit beside it");
    expect(refused([&] { dev.map(a + 20 * MiB, 2 * MiB, h); }), "a released handle maps nowhere");
    dev.unmap(a, 20 * MiB);
    expect(dev.used() == 20 * MiB, "one address left: still held");
    dev.unmap(a + 32 * MiB, 20 * MiB);
    expect(dev.used() == 0, "its last unmap frees it");
    expect(dev.create_physical(20 * MiB, &other), "and the memory serves again");
    dev.release_physical(other, 20 * MiB);
    expect(dev.used() == 0, "released unmapped: freed at once");
    expect(refused([&] { dev.release_physical(other, 20 * MiB); }), "a second release is misuse");
  }
  std::printf("%d checks\n", checks);
  return 0;
}
