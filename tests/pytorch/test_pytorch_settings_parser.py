"""allocwatch's parser against PyTorch's own, call by call: the same strings go to
torch.cuda.memory._set_allocator_settings' parser (c10's AcceleratorAllocatorConfig, driven by
pytorch_settings_probe.cpp, built against the installed torch: CPU builds have it too) and to
allocwatch's core as the native back end hands them over (parse_config(pytorch_call=True)),
and every key PyTorch's parser holds must agree afterwards: the values named, the
roundup_power2_divisions list syntax, and what a call that does not name a key does to it.

Needs torch and a C++ compiler; skips saying so otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.settings_cases import ROWS, good_values

from allocator_ext import _core

torch = pytest.importorskip("torch")
# One worker under pytest-xdist: the probe (`probe`) is compiled once.
pytestmark = pytest.mark.xdist_group("settings_probe")
PROBE = Path(__file__).resolve().parent / "pytorch_settings_probe.cpp"

# test/test_cuda.py's test_allocator_settings, in order, and calls that name several keys.
PYTORCHS_SEQUENCE = [
    "", "roundup_power2_divisions:4", "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:0.5,max_split_size_mb:40",
    "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
    "release_lock_on_cudamalloc:True",
    "expandable_segments:True,max_split_size_mb:40,max_non_split_rounding_mb:60",
    "roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[>:4]",
    "roundup_power2_divisions:[2:4,>:0]", "pinned_use_background_threads:True", "",
]
# Refused by both parsers.
REFUSED = ["garbage_collection_threshold:1.2", "max_split_size_mb:2",
           "roundup_power2_divisions:3", "expandable_segments:yes", "max_non_split_rounding_mb:1"]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    torch_dir = Path(torch.__file__).resolve().parent
    binary = tmp_path_factory.mktemp("settings_probe") / "probe"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    done = subprocess.run(
        [cxx, "-std=c++17", "-O1", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
         f"-I{torch_dir / 'include'}", str(PROBE), "-o", str(binary), f"-L{torch_dir / 'lib'}",
         "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return binary


def _pytorch(probe: Path, calls: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "ALLOCWATCH_"))}
    done = subprocess.run([str(probe)], input="".join(f"{c}\n" for c in calls),
                          capture_output=True, text=True, timeout=60, env=env, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


def _calls() -> list[str]:
    """PyTorch's test's calls, then each value of the table's PyTorch keys that PyTorch's
    parser holds, with a call naming none of them after each."""
    calls = list(PYTORCHS_SEQUENCE)
    for row in ROWS:
        for value, _ in good_values(row):
            if row["range"]["kind"] == "bool" and value not in ("True", "False"):
                continue  # allocwatch also takes true/false/1/0; PyTorch does not
            calls += [f"{row['key']}:{value}", "expandable_segments:False"]
    return calls


def test_allocwatchs_settings_follow_pytorchs_parser_call_by_call(probe: Path) -> None:
    calls = _calls()
    answers = _pytorch(probe, calls)
    assert len(answers) == len(calls)
    compared = set(answers[0]["settings"])
    assert compared <= {row["key"] for row in ROWS}
    ours = "native"
    for call, answer in zip(calls, answers, strict=True):
        if "error" in answer:  # a key PyTorch's accelerator-wide parser does not hold
            pytest.fail(f"PyTorch refused {call!r}: {answer['error'][:300]}")
        ours = _core.parse_config(call, ours, pytorch_call=True)["string"]
        items = dict(_core.config_items(ours))
        theirs = answer["settings"]
        for key in compared:
            if key == "garbage_collection_threshold":
                assert float(items[key]) == float(theirs[key]), (call, key)
            else:
                assert items[key] == theirs[key], (call, key, items[key], theirs[key])


def test_what_pytorchs_parser_refuses_allocwatchs_refuses(probe: Path) -> None:
    for call, answer in zip(REFUSED, _pytorch(probe, REFUSED), strict=True):
        assert "error" in answer, call
        with pytest.raises(ValueError):
            _core.parse_config(call, "native", pytorch_call=True)


# Whitespace around ',' ':' '[' ']': PyTorch's lexer drops it (std::isspace), and so does
# allocwatch's.
SPACED = [" max_split_size_mb : 40 ,\tgarbage_collection_threshold: 0.5 ",
          "roundup_power2_divisions:[ 256:1, 512 : 2, >:8 ]", "expandable_segments :True"]


def test_whitespace_around_separators_reads_as_pytorchs_parser_reads_it(probe: Path) -> None:
    tight = ["".join(call.split()) for call in SPACED]
    spaced_answers = _pytorch(probe, SPACED)
    assert spaced_answers == _pytorch(probe, tight)
    for call, same, answer in zip(SPACED, tight, spaced_answers, strict=True):
        assert "error" not in answer, (call, answer)
        assert (_core.parse_config(call, "native", pytorch_call=True)
                == _core.parse_config(same, "native", pytorch_call=True)), call


def test_a_space_inside_a_word_pytorch_glues_allocwatch_refuses_naming_the_key(
        probe: Path) -> None:
    # PyTorch's lexer glues the two halves: "1 28" reads as 128 without a word, and a ','
    # forgotten makes "True" and the next key one value it then refuses. allocwatch refuses
    # both, naming the key and the two words.
    glued, forgotten_comma = _pytorch(probe, ["max_split_size_mb:1 28",
                                              "expandable_segments:True max_split_size_mb:40"])
    assert "error" not in glued and glued["settings"]["max_split_size_mb"] == "128"
    assert "error" in forgotten_comma
    with pytest.raises(ValueError, match="max_split_size_mb: a space between '1' and '28'"):
        _core.parse_config("max_split_size_mb:1 28", "native", pytorch_call=True)
    with pytest.raises(ValueError, match="expandable_segments: a space between 'True' and "
                                         "'max_split_size_mb'"):
        _core.parse_config("expandable_segments:True max_split_size_mb:40", "native",
                           pytorch_call=True)
