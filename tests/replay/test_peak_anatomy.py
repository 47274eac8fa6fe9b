"""What reserved memory held at its peak (allocator_ext/replay/peak.py): every reserved byte in
one category, by the rules the module states, and `allocwatch replay` showing them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.peak import anatomy

MiB = 1 << 20
TRACES = REPO / "tests" / "data" / "traces"


def segment(address: int, blocks: list[tuple[int, str]], expandable: bool = True,
            kind: str = "large", pool: tuple[int, int] = (0, 0)) -> dict:
    """A snapshot segment of back-to-back blocks (size, state) from `address`."""
    out, at = [], address
    for size, state in blocks:
        out.append({"address": at, "size": size, "requested_size": size, "state": state})
        at += size
    return {"address": address, "total_size": at - address, "segment_type": kind,
            "is_expandable": expandable, "segment_pool_id": pool, "blocks": out}


def test_free_bytes_split_into_whole_pages_and_the_parts_of_pages_blocks_in_use_share() -> None:
    # 2 MiB pages: blocks in use over [0, 1) and [7, 8) MiB, a free block over [1, 7) MiB:
    # pages [2, 6) are wholly free; [1, 2) and [6, 7) share pages with the blocks in use.
    snap = {"segments": [segment(0, [(1 * MiB, "active_allocated"), (6 * MiB, "inactive"),
                                     (1 * MiB, "active_allocated")])]}
    a = anatomy(snap, reserved=8 * MiB, requested=2 * MiB, large_page=2 * MiB)
    assert (a.in_use, a.free_whole_pages, a.free_partial_pages, a.free_partial_pieces) == (
        2 * MiB, 4 * MiB, 2 * MiB, 1)
    assert a.mapped_ranges == 1


def test_each_kind_of_segment_has_its_category_and_they_add_up_to_reserved() -> None:
    snap = {"segments": [
        segment(0, [(2 * MiB, "active_allocated"), (2 * MiB, "active_pending_free")]),
        segment(64 * MiB, [(3 * MiB, "active_allocated"), (1 * MiB, "inactive")],
                expandable=False),                                     # a cudaMalloc segment
        segment(128 * MiB, [(2 * MiB, "inactive")], kind="small"),       # one whole small page
        segment(192 * MiB, [(4 * MiB, "inactive")], pool=(1, 0)),        # a graph's pool
    ]}
    a = anatomy(snap, reserved=14 * MiB, requested=7 * MiB, large_page=20 * MiB)
    assert a.in_use == 5 * MiB and a.waiting == 2 * MiB
    assert a.free_plain_segments == 1 * MiB
    assert a.free_whole_pages == 2 * MiB      # the small pool's page is 2 MiB, whatever large's
    assert a.private_pools == 4 * MiB and a.free_partial_pages == 0
    assert (a.in_use + a.waiting + a.free_partial_pages + a.free_whole_pages
            + a.free_plain_segments + a.private_pools) == a.reserved


def test_old_addresses_of_moved_pages_are_not_counted_as_waiting() -> None:
    # The snapshot lists a moved range as pending until the device is past the move, but its
    # memory counts where it went: what the snapshot lists beyond reserved memory is that.
    snap = {"segments": [segment(0, [(4 * MiB, "active_allocated"),
                                     (2 * MiB, "active_pending_free")])]}
    a = anatomy(snap, reserved=4 * MiB, requested=4 * MiB, large_page=2 * MiB)
    assert a.waiting == 0 and a.in_use == a.reserved


@pytest.mark.parametrize("config", [None, "native", "native,expandable_segments:True"])
@pytest.mark.parametrize("name", ["convnet__default", "stream_pipeline__default_lockstep",
                                  "reduce_overhead__default"])
def test_at_a_replays_peak_every_reserved_byte_is_in_one_category(name: str, config) -> None:
    report = replay(load_trace(TRACES / f"{name}.pickle.gz"), config=config,
                    explain_peak=True).report
    a = report["peak_anatomy"]
    assert a["reserved"] == report["peak_reserved_bytes"]
    assert sum(a[k] for k in ("in_use", "waiting", "free_partial_pages", "free_whole_pages",
                              "free_plain_segments", "private_pools")) == a["reserved"]
    # What the program held then is in blocks in use or waiting, each rounded up.
    assert a["in_use"] + a["waiting"] >= a["requested"]
    if config == "native":
        assert a["free_whole_pages"] == a["free_partial_pages"] == 0   # no expandable segment
    if name == "reduce_overhead__default":
        assert a["private_pools"] > 0
    if name.startswith("stream_pipeline") and config is None:
        assert a["waiting"] > 0     # its record_stream frees wait for the consumer


def test_with_aliased_pages_each_address_is_listed_so_the_parts_add_up_to_more() -> None:
    report = replay(load_trace(TRACES / "stream_pipeline__default_lockstep.pickle.gz"),
                    config="alias_pages:True,expandable_chunk_mb:2", explain_peak=True).report
    a = report["peak_anatomy"]
    parts = sum(a[k] for k in ("in_use", "waiting", "free_partial_pages", "free_whole_pages",
                               "free_plain_segments", "private_pools"))
    assert parts >= a["reserved"] == report["peak_reserved_bytes"]
    assert a["in_use"] + a["waiting"] >= a["requested"]


def test_replay_command_shows_the_floor_and_the_peak() -> None:
    trace = str(TRACES / "stream_pipeline__default_lockstep.pickle.gz")
    run = [sys.executable, "-m", "exporter.cli", "replay", trace]
    text = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "floor              1.0208" in text.stdout
    assert "at the peak" in text.stdout and "waiting" in text.stdout
    js = subprocess.run([*run, "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    report = json.loads(js.stdout)
    assert report["floor"]["bar"] == pytest.approx(report["floor"]["floor_ratio"] + 0.01)
    assert report["peak_anatomy"]["reserved"] == report["peak_reserved_bytes"]
