"""Settings: PYTORCH_CUDA_ALLOC_CONF syntax, the native preset, key-by-key runtime changes,
and refusal of bad input that names what is wrong and changes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.native_checks import run_native_checks

import allocator_ext as ae
from allocator_ext import _core

MiB = 1 << 20


def test_no_settings_means_allocwatchs_defaults() -> None:
    a = ae.Allocator(ae.SimDevice())
    assert a.config_string() == ae.DEFAULT_CONFIG
    assert a.config()["expandable_segments"] is True


def test_native_means_pytorchs_defaults() -> None:
    c = ae.parse_config("native")
    assert c["string"] == "native"
    assert c["expandable_segments"] is False and c["max_split_size"] == -1
    assert c["garbage_collection_threshold"] == 0 and c["max_non_split_rounding"] == 20 * MiB
    assert set(c["roundup_power2_divisions"].values()) == {0}


def test_keys_after_native_override_it() -> None:
    c = ae.parse_config("native,expandable_segments:True,max_split_size_mb:512")
    assert c["expandable_segments"] is True and c["max_split_size"] == 512 * MiB
    assert c["string"] == "native,max_split_size_mb:512,expandable_segments:True"


def test_the_settings_string_parses_back_to_the_same_settings() -> None:
    text = "native,garbage_collection_threshold:0.8,roundup_power2_divisions:[256:1,512:2,>:8]"
    c = ae.parse_config(text)
    assert ae.parse_config(c["string"]) == c


def test_roundup_list_syntax_sets_intervals_like_pytorch() -> None:
    d = ae.parse_config("native,roundup_power2_divisions:[64:4,256:2]")
    d = d["roundup_power2_divisions"]
    # Intervals before the first one named take its value; later ones keep theirs (0).
    assert [d[k] for k in ("1", "32", "64", "128", "256", "512")] == [4, 4, 4, 0, 2, 0]
    # '>' fills the intervals after the last one named, as PyTorch's parser does (2.9 and
    # later; tests/pytorch/test_pytorch_settings_parser.py compares with it): "[256:1,512:2,>:8]"
    # leaves 512 MiB at 2.
    c = ae.parse_config("native,roundup_power2_divisions:[256:1,512:2,>:8]")
    d = c["roundup_power2_divisions"]
    assert [d[k] for k in ("1", "256", "512", "1024", "32768")] == [1, 1, 2, 8, 8]


def test_a_runtime_change_touches_only_the_named_keys() -> None:
    a = ae.Allocator(ae.SimDevice(), "native,max_split_size_mb:512,expandable_segments:True")
    a.set_config("garbage_collection_threshold:0.6")
    c = a.config()
    assert c["garbage_collection_threshold"] == 0.6
    assert c["max_split_size"] == 512 * MiB and c["expandable_segments"] is True
    assert a.stats()["max_split_size"] == 512 * MiB


@pytest.mark.parametrize("text,named", [
    ("max_split_size_mb:abc", "max_split_size_mb:abc"),
    ("max_split_size_mb:-5", "max_split_size_mb:-5"),
    ("max_split_size_mb:10", "must be at least 20"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold:1.5"),
    ("garbage_collection_threshold:0", "strictly between 0 and 1"),
    ("garbage_collection_threshold:nan", "garbage_collection_threshold:nan"),
    ("expandable_segments:yes", "expandable_segments:yes"),
    ("roundup_power2_divisions:3", "power of two"),
    ("roundup_power2_divisions:[256:3]", "power of two"),
    ("no_such_key:1", "no_such_key"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
    ("expandable_segments", "missing"),
    ("expandable_segments:True,", "invalid allocator settings 'expandable_segments:True,': "
                                  "it ends with ','"),
    ("native,,garbage_collection_threshold:0.8", "an empty entry between two ','"),
    ("expandable_segments:True,native", "the preset must come first"),
    ("expandable_grow_mb:3", "multiple of 2"),
])
def test_bad_settings_are_refused_with_a_message_naming_them(text: str, named: str) -> None:
    with pytest.raises(ValueError) as err:
        ae.parse_config(text)
    assert named in str(err.value)


def test_whitespace_around_separators_is_dropped_as_pytorchs_lexer_drops_it() -> None:
    spaced = " native , expandable_segments : True,\tgarbage_collection_threshold: 0.6 ,\n" \
             "roundup_power2_divisions:[ 256:1, >: 4 ]"
    assert ae.parse_config(spaced) == ae.parse_config(
        "native,expandable_segments:True,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,>:4]")
    assert ae.parse_config("max_split_size_mb: 128")["max_split_size"] == 128 * MiB


@pytest.mark.parametrize("text,message", [
    # A ',' forgotten: PyTorch's lexer would glue "True" and the next key into one value.
    ("expandable_segments:True garbage_collection_threshold:0.6",
     "invalid allocator setting expandable_segments: a space between 'True' and "
     "'garbage_collection_threshold' (settings are separated by ',')"),
    # ... and read this as 128.
    ("max_split_size_mb:1 28",
     "invalid allocator setting max_split_size_mb: a space between '1' and '28'"),
    ("native,roundup_power2_divisions:[256:1, 5 12:2]",
     "invalid allocator setting roundup_power2_divisions: a space between '5' and '12'"),
])
def test_a_space_inside_a_word_is_refused_by_the_core_naming_the_key(text: str,
                                                                      message: str) -> None:
    # Straight to the core, past the Python check (check_settings_text) that the command line
    # and the sidecar make first: torch.cuda.memory._set_allocator_settings under the native
    # back end reaches the core with nothing in between.
    a = ae.Allocator(ae.SimDevice(), "native,max_split_size_mb:512")
    before = a.config()
    for refuse in (lambda: ae.parse_config(text), lambda: ae.parse_config(text, pytorch_call=True),
                   lambda: a.set_config(text), lambda: _core.known_settings(text)):
        with pytest.raises(ValueError) as err:
            refuse()
        assert message in str(err.value)
    assert a.config() == before


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_parser_on_its_own_takes_whitespace_as_its_comments_say(tmp_path: Path) -> None:
    out = run_native_checks(tmp_path, "config_test", "core/config.cpp")
    assert out.count("ok  ") >= 12


def test_a_refused_change_leaves_the_settings_in_force() -> None:
    a = ae.Allocator(ae.SimDevice(), "native,max_split_size_mb:512")
    before = a.config()
    with pytest.raises(ValueError, match="garbage_collection_threshold:2"):
        # The first key is fine; the second is not: nothing may change.
        a.set_config("expandable_segments:True,garbage_collection_threshold:2")
    assert a.config() == before


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abcdegilmnoprstuxTF_:,[]>0123456789.- ", max_size=60))
def test_any_text_is_either_accepted_or_refused_cleanly(text: str) -> None:
    a = ae.Allocator(ae.SimDevice(), "native")
    before = a.config()
    try:
        a.set_config(text)
    except ValueError as e:
        assert "invalid allocator setting" in str(e)
        assert a.config() == before
    else:
        assert ae.parse_config(a.config_string()) == a.config()
