"""The floor of a trace: the least peak reserved memory that an allocator following the core's
rules could reach on the recorded program, as a ratio to its peak requested bytes.

Peak reserved ÷ peak requested is 1.00 only for an allocator that wastes nothing. What no
allocator can avoid under the core's rules sets the floor, and it counts:

- memory that must wait for events: a block freed while other streams may still use it
  (record_stream) keeps its bytes until those streams' work is done, where the trace records
  its `free_completed`; until then its bytes count as requested (PyTorch's
  `requested_bytes` counts them so, and so do the core and the replay), and as held;
- page granularity: the device maps memory in pages (2 MiB); a block lives in a segment of one
  stream and one pool (requests up to 1 MiB in the small pool, the rest in the large; a CUDA
  graph's or a MemPool's private pool has its own, as the snapshot's segments say), so each
  stream's pool needs whole pages for what it holds, at best packed without a gap;
- private pools keep their memory: a CUDA graph replays into the memory its capture used,
  freed blocks included, so a pool gives nothing back while it lives (PyTorch releases a
  graph's pool only once the graph is gone; a pool the snapshot still lists lived to the end
  of the trace), and its pages count at the most it has held;
- sizes rounded to 512 bytes, as every block is.

At each event of the trace the floor takes, for every (stream, pool), its live and waiting
bytes rounded up to whole pages (a private pool's most so far), and sums them; its peak over
the trace, over the trace's peak requested bytes, is the ratio no allocator can go below on
that trace. It is a lower
bound, not a layout: it assumes perfect packing inside each stream's pages at every moment,
which an allocator that cannot move live blocks does not always reach. The fragmentation
bar is the floor + 0.01 where the floor is above 1.00.
"""

from __future__ import annotations

from dataclasses import dataclass

from allocator_ext.replay.trace import Trace, peak_requested_bytes, private_pools

PAGE_BYTES = 2 << 20        # the device's mapping granularity, and the core's page size
BAR = 1.01                  # the fragmentation bar where the floor leaves room for it
BAR_OVER_FLOOR = 0.01       # and what it allows over a floor above 1.00
SMALL_REQUEST = 1 << 20     # requests up to this size are served from the small pool
BLOCK_ROUNDING = 512        # every block's size is a multiple of this


@dataclass(frozen=True)
class Floor:
    peak_requested_bytes: int  # the most requested at once (waiting frees included)
    floor_bytes: int           # the least peak reserved memory any allocator could reach
    page_bytes: int

    @property
    def ratio(self) -> float:
        """floor_bytes ÷ peak_requested_bytes: where peak reserved ÷ peak requested cannot go
        below on this trace."""
        return self.floor_bytes / self.peak_requested_bytes if self.peak_requested_bytes else 1.0

    @property
    def bar(self) -> float:
        """The fragmentation bar on this trace: 1.01, or the floor + 0.01 where the floor is
        above 1.00."""
        return max(BAR, self.ratio + BAR_OVER_FLOOR)

    def as_dict(self) -> dict[str, float | int]:
        return {"peak_requested_bytes": self.peak_requested_bytes,
                "floor_bytes": self.floor_bytes, "page_bytes": self.page_bytes,
                "floor_ratio": self.ratio, "bar": self.bar}


def _pages(size: int, page: int) -> int:
    return -(-size // page)


def reserved_floor(trace: Trace, page_bytes: int = PAGE_BYTES) -> Floor:
    """The floor of `trace` (see the module's description)."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    # As peak_requested_bytes counts them: a request holds its bytes from its alloc to its
    # free_completed (waiting for other streams' events included).
    Key = tuple[int, tuple[int, int] | None, bool]          # (stream, private pool, small)
    live: dict[int, tuple[int, Key]] = {}                   # address -> (request, key)
    held: dict[Key, int] = {}                               # key -> rounded bytes
    kept: dict[Key, int] = {}                               # private pool -> most pages held
    pool_of = private_pools(trace)
    pages = peak_pages = 0
    for i, e in enumerate(trace.events):
        if e.action == "alloc":
            key = (e.stream, pool_of[i], e.size <= SMALL_REQUEST)
            live[e.addr] = (e.size, key)
            size = -(-e.size // BLOCK_ROUNDING) * BLOCK_ROUNDING
            before = held.get(key, 0)
            held[key] = before + size
            if key[1] is None:
                pages += _pages(before + size, page_bytes) - _pages(before, page_bytes)
            else:  # a private pool keeps the most it has held: only more adds pages
                most = kept.get(key, 0)
                kept[key] = max(most, _pages(before + size, page_bytes))
                pages += kept[key] - most
            peak_pages = max(peak_pages, pages)
        elif e.action == "free_completed" and e.addr in live:
            request, key = live.pop(e.addr)
            size = -(-request // BLOCK_ROUNDING) * BLOCK_ROUNDING
            before = held[key]
            held[key] = before - size
            if key[1] is None:
                pages -= _pages(before, page_bytes) - _pages(before - size, page_bytes)
    return Floor(peak_requested_bytes(trace), peak_pages * page_bytes, page_bytes)
