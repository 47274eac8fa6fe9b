"""What reserved memory held at its peak: where a replay's reserved ÷ requested comes from.

At the moment reserved memory is highest, every reserved byte lies in a segment (an expandable
segment's mapped range, or a plain segment) and in one block of it, and so falls into one of:

- in use: blocks handed out (sizes rounded to 512 bytes, so a little over what was requested);
- waiting: blocks freed while another stream may still use them (record_stream), until their
  events complete (Note [waiting frees] in core/allocator.cpp);
- free in partly used pages: free bytes of an expandable segment in pages that a block in use
  (or waiting) shares. Pages map whole, so no rule can give them back while that block lives;
  only a layout with fewer, longer mapped ranges has fewer of them;
- free whole pages: pages with nothing in them, still mapped. The take-back moves them where a
  segment grows and a reclaim gives them back, so at a peak they are memory the page rules
  kept on purpose (below the high-water mark) or could not move in time;
- free in plain segments: free bytes of segments made with cudaMalloc (PyTorch's allocator
  without expandable segments), which go back only with their whole segment;
- private pools: free bytes in the pools of CUDA graphs and MemPools, which keep their memory
  while they live.

A snapshot also lists the old addresses of pages moved elsewhere until the device is past the
move (Note [moving pages]); their memory counts where it went, so they are left out, as what
the snapshot lists beyond reserved memory. With alias_pages a snapshot lists a page at each of
its addresses and the breakdown may add up to more than reserved memory.

`PeakWatch` follows a replay step by step and keeps the breakdown at each new high of reserved
memory; the last one kept is the peak's."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SMALL_PAGE_BYTES = 2 << 20  # the small pool's page (kSmallBuffer)


@dataclass(frozen=True)
class PeakAnatomy:
    reserved: int
    requested: int               # what the program held then (waiting frees included)
    in_use: int
    waiting: int
    free_partial_pages: int
    free_partial_pieces: int     # free blocks with bytes in partly used pages
    free_whole_pages: int
    free_plain_segments: int
    private_pools: int
    mapped_ranges: int           # expandable segments' mapped ranges and plain segments

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _whole_pages(ptr: int, size: int, page: int) -> int:
    """The bytes of [ptr, ptr + size) that fill whole pages."""
    first = -(-ptr // page) * page
    last = (ptr + size) // page * page
    return max(0, last - first)


def anatomy(snapshot: dict[str, Any], reserved: int, requested: int,
            large_page: int, aliased: bool = False) -> PeakAnatomy:
    """The breakdown of `reserved` bytes by the allocator's `snapshot` (PyTorch's layout),
    with `requested` the bytes the program held then and `large_page` the large pool's page
    size in expandable segments; `aliased`: the large pool aliases pages, and the snapshot
    lists each address of a page."""
    listed = in_use = pending = partial = pieces = whole = plain = private = 0
    segments = snapshot["segments"]
    for seg in segments:
        listed += seg["total_size"]
        pool_id = seg.get("segment_pool_id") or (0, 0)
        in_private_pool = tuple(pool_id) != (0, 0)
        page = SMALL_PAGE_BYTES if seg["segment_type"] == "small" else large_page
        for block in seg["blocks"]:
            size, state = block["size"], block["state"]
            if state == "active_allocated":
                in_use += size
            elif state == "active_pending_free":
                pending += size
            elif in_private_pool:
                private += size
            elif not seg["is_expandable"]:
                plain += size
            else:
                full = _whole_pages(block["address"], size, page)
                whole += full
                if size > full:
                    partial += size - full
                    pieces += 1
    # Listed but not reserved: old addresses of moved pages, pending like waiting blocks (with
    # aliased pages, the extra addresses of pages too: nothing is told apart then).
    moved_away = 0 if aliased else max(0, listed - reserved)
    return PeakAnatomy(reserved, requested, in_use, max(0, pending - moved_away), partial, pieces,
                       whole, plain, private, len(segments))


class PeakWatch:
    """A Replayer `after_step` callback: the breakdown at each new high of reserved memory,
    `anatomy` the last (the peak's) once the pass is over. A snapshot is taken only at a new
    high, which a replay reaches a few hundred times at most."""

    def __init__(self, replayer: Any) -> None:
        self.replayer = replayer
        config = replayer.allocator.config()
        self.large_page = int(config["expandable_large_page"])
        self.high = 0
        self.anatomy: PeakAnatomy | None = None

    def __call__(self, _event: Any) -> None:
        reserved = self.replayer.allocator.reserved_bytes
        if reserved <= self.high:
            return
        self.high = reserved
        self.anatomy = anatomy(self.replayer.allocator.snapshot(), reserved,
                               self.replayer.requested, self.large_page,
                               self.replayer.allocator.aliases_pages)
