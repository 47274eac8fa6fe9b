"""Messages and outputs that tell the truth: settings printed as written, sizes by one rule,
a plot that cannot be written losing nothing else, tune's chart and table readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.control import two_agents_running

from allocator_ext.replay.sizes import parse_size
from allocator_ext.replay.tune import Candidate
from exporter.cli import main
from exporter.commands.tune import _table, chart
from exporter.sidecar.config import load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "allocator_ext" / "data" / "example_trace.pickle.gz")
GiB = 1 << 30


def test_check_config_prints_the_settings_as_a_user_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = tmp_path / "sidecar.yaml"
    written.write_text("agents:\n  socket_mode: '0640'\n  max_message_bytes: 4194304\n"
                       "policy:\n  interval: 500ms\n  rules:\n    - name: fragmented\n"
                       "      metric: peak_fragmentation_ratio\n      above: 0.4\n"
                       "      for: 30s\n      cooldown: 5m\n")
    assert main(["sidecar", "--config", str(written), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert 'socket_mode: "0640"' in out and 'socket_mode: "0600"' in out  # agents, admin
    assert "432" not in out and "416" not in out  # 0o660 and 0o640 as decimal numbers
    assert "max_message_bytes: 4194304  # 4 MiB" in out
    assert "interval: 500ms" in out and "for: 30s" in out and "cooldown: 5m" in out
    # What it prints is a settings file that reads back as the same settings.
    printed = out.split("\n", 1)[1]
    assert parse_config(yaml.safe_load(printed)) == load_config(written)


@pytest.mark.parametrize("text,size", [
    ("123456789B", 123456789), ("512MiB", 512 << 20), ("512M", 512 << 20), ("1.5G", 3 << 29),
    ("80GiB", 80 * GiB), ("1T", 1 << 40), ("1TiB", 1 << 40), ("4k", 4096),
    # exact, where a float would round: 2**64 - 1 bytes is the largest a size_t holds
    ("18446744073709551615B", (1 << 64) - 1), ("0.1K", 102)])
def test_every_size_unit_is_a_power_of_1024(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80", "1.03", "123456789"])
def test_a_number_without_a_unit_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=f"'{text}' has no unit: write {text}G"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1TB", "80GB", "512MB", "4kb"])
def test_units_read_both_ways_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="ambiguous"):
        parse_size(text)


def test_a_plot_that_cannot_be_written_keeps_the_table(tmp_path: Path) -> None:
    taken = tmp_path / "a-directory.png"
    taken.mkdir()  # its parent exists, so the check before the replay lets it pass
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "replay", EXAMPLE,
                             "--plot", str(taken)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "peak reserved" in result.stdout and "reserved/requested" in result.stdout
    assert f"--plot {taken}: cannot write it" in result.stderr
    assert "Traceback" not in result.stderr


def test_ctl_snapshot_to_a_missing_directory_asks_no_agent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with two_agents_running(tmp_path) as (running, address, _):
        before = running.sidecar.registry.counters()[1]
        assert main(["ctl", "--admin", address, "snapshot", "-o",
                     str(tmp_path / "missing" / "x.gz")]) == 2
        assert f"there is no directory {tmp_path / 'missing'}" in capsys.readouterr().err
        assert running.sidecar.registry.counters()[1] == before  # no command was sent


def _candidate(name: str, reserved_gib: float, ooms: int = 0) -> Candidate:
    reserved = int(reserved_gib * GiB)
    return Candidate(name=name, settings=name, pytorch_conf=None, report={
        "peak_reserved_bytes": reserved, "reserved_ratio": reserved / (9.5 * GiB),
        "num_alloc_retries": 0, "num_ooms": ooms, "num_device_alloc": 100,
        "num_device_free": 10, "device_call_share": 0.001})


RANKED = [_candidate("allocwatch defaults", 9.52), _candidate("expandable segments", 9.7),
          _candidate("pytorch defaults", 10.3),
          _candidate("max_split_size_mb:128, a long candidate name", 41.0),
          _candidate("capped", 9.6, ooms=2)]


def test_tune_table_columns_line_up_whatever_the_names() -> None:
    lines = _table(RANKED)
    assert len({len(line) for line in lines}) == 1, lines
    ratio_end = lines[0].index("ratio") + len("ratio")
    for line in lines[1:]:
        assert line[ratio_end - 5:ratio_end].strip().replace(".", "").isdigit(), line


def test_tune_chart_shows_small_differences_and_says_what_it_cuts() -> None:
    fig = chart(RANKED, RANKED[0], int(9.5 * GiB), "allocwatch tune: peak reserved by setting")
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == "allocwatch tune: peak reserved by setting"
    left, right = ax.get_xlim()
    # Bars start at peak requested, not 0: 9.52 and 10.3 GiB are a small and a long bar.
    assert left == pytest.approx(9.5) and right < 12
    labels = [t.get_text() for t in ax.texts]
    assert "9.52 GiB  (1.002×)" in labels and "10.30 GiB  (1.084×)" in labels
    assert "41.00 GiB  (4.316×) ▶" in labels  # beyond the axis: cut, and its value written
    assert "9.60 GiB, 2 OOMs" in labels
    import matplotlib.pyplot as plt

    plt.close(fig)
