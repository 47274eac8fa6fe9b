"""The settings table (allocator_ext/csrc/core/settings_table.h, exposed as
allocator_ext._core.SETTINGS) is the one list of allocator settings: every test here walks its
rows (values from tests/support/settings_cases.py), so a new row is parsed, range-checked,
written back, reset and documented without a test naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.settings_cases import KEYS, ROWS, bad_values, busy_settings, good_values, other_value

import allocator_ext as ae
from allocator_ext import _core, settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "torch.md"
ARCHITECTURE = DOCS.with_name("architecture.md")
NATIVE_ITEMS = dict(_core.config_items("native"))


@pytest.mark.parametrize("row", ROWS, ids=KEYS)
def test_every_setting_takes_its_values_and_writes_them_back(row: dict) -> None:
    key = row["key"]
    for value, shown in good_values(row):
        items = dict(_core.config_items(f"native,{key}:{value}"))
        if shown is not None:
            assert items[key] == shown, (value, items[key])
        # items() writes what parses back to the same settings, and changes nothing else.
        assert dict(_core.config_items(f"native,{key}:{items[key]}")) == items
        assert {k: v for k, v in items.items() if k != key} == \
            {k: v for k, v in NATIVE_ITEMS.items() if k != key}
        parsed = ae.parse_config(f"native,{key}:{value}")
        assert ae.parse_config(parsed["string"]) == parsed
        assert dict(_core.config_items(parsed["string"])) == items


@pytest.mark.parametrize("row", ROWS, ids=KEYS)
def test_every_setting_refuses_what_is_out_of_range_naming_key_and_value(row: dict) -> None:
    key = row["key"]
    allocator = ae.Allocator(ae.SimDevice(), busy_settings())
    before = allocator.config()
    first_other = next(r for r in ROWS if r["key"] != key and other_value(r) is not None)
    for value, named in bad_values(row):
        for text in (f"{key}:{value}",
                     # a good key before the bad one: still nothing changes
                     f"{first_other['key']}:{good_values(first_other)[-1][0]},{key}:{value}"):
            with pytest.raises(ValueError) as err:
                allocator.set_config(text)
            assert str(err.value).startswith("invalid allocator setting"), str(err.value)
            assert named in str(err.value), (text, str(err.value))
            assert allocator.config() == before, text
            with pytest.raises(ValueError):
                ae.parse_config(text, pytorch_call=True)


def test_an_unknown_key_is_refused_with_every_known_key_listed() -> None:
    with pytest.raises(ValueError) as err:
        ae.parse_config("native,no_such_key:1")
    listed = re.search(r"known: (.*); preset: native\)", str(err.value))
    assert listed is not None, str(err.value)
    assert tuple(listed.group(1).split(", ")) == KEYS


def test_the_binding_dictionary_has_every_setting_under_its_name() -> None:
    parsed = ae.parse_config(busy_settings())
    assert set(parsed) == {row["name"] for row in ROWS} | {"string"}
    # Each value as Python has it agrees with what items() writes.
    items = dict(_core.config_items(busy_settings()))
    for row in ROWS:
        value, shown = items[row["key"]], parsed[row["name"]]
        kind = row["range"]["kind"]
        if kind == "bool":
            assert shown is (value == "True")
        elif kind == "whole":
            scale = (1 << 20) if row["range"]["unit"] == "MiB" else 1
            assert shown == (-1 if value == "unlimited" else int(value) * scale)
        elif kind == "real":
            assert shown == float(value)
        elif kind == "divisions":
            assert value == "[" + ",".join(f"{k}:{v}" for k, v in shown.items()) + "]"
        else:
            assert shown == value


def test_the_presets_are_the_tables_defaults() -> None:
    assert [v for _, v in _core.config_items("native")] == [r["native_default"] for r in ROWS]
    assert [v for _, v in _core.config_items("")] == [r["default"] for r in ROWS]
    assert ae.parse_config("") == ae.parse_config(ae.DEFAULT_CONFIG, "native")
    assert ae.NATIVE_CONFIG == "native"


def test_every_key_is_known_to_the_split_of_pytorch_settings() -> None:
    busy = busy_settings()
    text = busy + ",per_process_memory_fraction:0.5,graph_capture_record_stream_reuse:True"
    known, others = _core.known_settings(text)
    assert known == busy
    assert others == [("per_process_memory_fraction", "0.5"),
                      ("graph_capture_record_stream_reuse", "True")]
    assert {entry.split(":")[0] for entry in known.split(",")[1:]} == \
        {row["key"] for row in ROWS if other_value(row) is not None}


def test_a_pytorch_call_resets_what_pytorch_resets_and_keeps_the_rest() -> None:
    """_set_allocator_settings under the native back end (pytorch_call): each setting the call
    does not name goes back to its default where its row says 'resets', as PyTorch's parser
    does to its own keys, and keeps its value otherwise; allocwatch's own changes (set_config,
    ctl set) change only what they name."""
    busy = ae.parse_config(busy_settings())
    native = ae.parse_config("native")
    resets = [row for row in ROWS if row["on_pytorch_call"] == "resets"]
    assert {row["key"] for row in resets} == {
        "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
        "roundup_power2_divisions"}  # PyTorch's parseArgs, c10/core/AllocatorConfig.cpp
    after = ae.parse_config("", busy_settings(), pytorch_call=True)
    for row in ROWS:
        expected = native if row["on_pytorch_call"] == "resets" else busy
        assert after[row["name"]] == expected[row["name"]], row["key"]
    # A key the call names takes the value named, whether its row resets or keeps.
    for row in ROWS:
        value = good_values(row)[-1][0]
        named = ae.parse_config(f"{row['key']}:{value}", busy_settings(), pytorch_call=True)
        alone = ae.parse_config(f"native,{row['key']}:{value}")
        assert named[row["name"]] == alone[row["name"]], row["key"]
        for other in ROWS:
            if other is row:
                continue
            expected = native if other["on_pytorch_call"] == "resets" else busy
            assert named[other["name"]] == expected[other["name"]], (row["key"], other["key"])
    # allocwatch's own run-time changes: only what is named.
    assert ae.parse_config("", busy_settings()) == busy
    allocator = ae.Allocator(ae.SimDevice(), busy_settings())
    allocator.set_config("expandable_segments:False")
    assert allocator.config() == {**busy, "expandable_segments": False,
                                  "string": allocator.config()["string"]}


def test_a_setting_that_resets_has_one_default() -> None:
    """Where PyTorch's parser resets a key, the preset does not matter: both defaults agree."""
    for row in ROWS:
        if row["on_pytorch_call"] == "resets":
            assert row["native_default"] == row["default"], row["key"]


def test_the_docs_list_every_setting_as_the_table_says() -> None:
    """docs/torch.md holds the table `python -m allocator_ext.settings` prints."""
    text = DOCS.read_text()
    assert settings.markdown() in text, (
        "docs/torch.md's settings table differs from the core's: paste the output of "
        "`python3 -m allocator_ext.settings` over it")
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M)
    assert [key for key in documented if key in KEYS] == list(KEYS)


def test_the_architecture_page_states_allocwatchs_defaults_as_they_are() -> None:
    assert f"`{ae.DEFAULT_CONFIG}`" in ARCHITECTURE.read_text()
