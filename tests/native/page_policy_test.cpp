// PagePolicy on its own (core/page_policy.h): what it remembers and when it forgets.
// Built and run by tests/core/test_page_policy.py; prints one line per check and exits non-zero
// at the first that fails.
#include <cstdio>
#include <cstdlib>

#include "core/page_policy.h"
#include "expect.h"

using allocwatch::PagePolicy;

using allocwatch_tests::checks;
using allocwatch_tests::expect;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

}  // namespace

int main() {
  {
    PagePolicy p;
    p.reserved(100 * MiB);
    p.reserved(60 * MiB);
    expect(p.high_water() == 100 * MiB, "the mark is the most ever reserved");
    expect(!p.above_high_water(100 * MiB), "growth up to the mark raises no peak");
    expect(p.above_high_water(101 * MiB), "growth past the mark does");
    p.reclaimed(40 * MiB);
    expect(p.high_water() == 40 * MiB && p.above_high_water(41 * MiB),
           "an explicit reclaim lowers the mark to what it leaves");
  }
  {
    PagePolicy p;
    expect(!p.single_pages(1000 * MiB), "no limit, no refusal: growth is chunked");
    p.growth_refused(1000 * MiB);
    expect(!p.single_pages(950 * MiB) && p.single_pages(951 * MiB),
           "within 5 % of where the device refused growth, single pages");
    p.mapped(900 * MiB);
    expect(p.single_pages(951 * MiB), "growth below where the device refused keeps it");
    p.mapped(1001 * MiB);
    expect(!p.single_pages(1001 * MiB), "growth past it forgets it");
    p.growth_refused(500 * MiB);
    p.limit_set(/*below_whole_device=*/false);
    expect(!p.single_pages(499 * MiB), "a new memory limit forgets where the device refused");
  }
  {
    PagePolicy p;
    p.limit_set(/*below_whole_device=*/true);
    expect(p.single_pages(1 * MiB), "under a memory limit, single pages from the start");
    p.mapped(2000 * MiB);
    expect(p.single_pages(1 * MiB), "the limit stays whatever is mapped");
    p.limit_set(/*below_whole_device=*/false);
    expect(!p.single_pages(999 * MiB) && !p.single_pages(1 * MiB),
           "a limit of the whole device, or none, is no limit");
  }
  {
    PagePolicy p;
    p.begin_growth(7, 64 * MiB, 300 * MiB);
    expect(!p.growth_moved_before(), "a first growth has not moved pages before");
    expect(!p.repeats_page_move(), "its first move is no repetition");
    expect(!p.repeats_page_move(), "a second move within the same growth counts as one");
    p.begin_growth(7, 64 * MiB, 300 * MiB);
    expect(p.growth_moved_before(), "the same request with the same bytes allocated recurs");
    expect(p.repeats_page_move(), "moving again for it repeats a move: a cycle");
    p.begin_growth(7, 64 * MiB, 301 * MiB);
    expect(!p.repeats_page_move(), "another moment of the step is another growth");
    p.begin_growth(8, 64 * MiB, 300 * MiB);
    expect(!p.growth_moved_before(), "another stream is another growth");
    p.reclaimed(0);
    p.begin_growth(7, 64 * MiB, 300 * MiB);
    expect(!p.growth_moved_before() && !p.repeats_page_move(),
           "an explicit reclaim forgets the growths seen");
  }
  std::printf("%d checks passed\n", checks);
  return 0;
}
