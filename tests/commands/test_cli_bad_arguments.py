"""Every subcommand, and every `ctl` subcommand, given bad arguments: a message that names what
is wrong, a non-zero exit status, never a traceback, and nothing done.

Run in-process through exporter.cli.main, the `allocwatch` entry point: an exception escaping
it is what a user would see as a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exporter.cli import build_parser, main
from exporter.commands.ctl import SUBCOMMANDS

EXAMPLE = str(Path(__file__).resolve().parents[2] / "allocator_ext" / "data" /
              "example_trace.pickle.gz")
UNREACHABLE = "unix:///nonexistent/allocwatch/admin.sock"


BAD_YAML = "agents:\n  socket_mod: '0660'\n"  # a typo of socket_mode


def _cases(bad_yaml: Path) -> list[tuple[list[str], str]]:
    """(arguments, what the message must say); `bad_yaml`: a file holding BAD_YAML."""
    return [
        (["sidecar", "--config", "/nonexistent/sidecar.yaml"],
         "cannot read settings file /nonexistent/sidecar.yaml"),
        (["sidecar", "--config", str(bad_yaml)], "agents.socket_mod: unknown setting"),
        (["sidecar", "--exit-grace", "-1"], "--exit-grace: -1"),
        (["demo", "--duration", "-5"], "--duration: -5: give a number of seconds above 0"),
        (["demo", "--duration", "nan"], "--duration: nan"),
        (["demo", "--port", "99999"], "--port: 99999: a TCP port is 1-65535"),
        (["demo", "--workload", "tpu"], "--workload: invalid choice: 'tpu'"),
        (["replay", "/nonexistent/trace.pickle"], "cannot read /nonexistent/trace.pickle"),
        (["replay", EXAMPLE, "--plot", "/nonexistent/dir/x.png"],
         "--plot /nonexistent/dir/x.png: there is no directory /nonexistent/dir"),
        (["replay", EXAMPLE, "--device-memory", "0B"], "--device-memory 0B: a cap of 0 bytes"),
        (["replay", EXAMPLE, "--device-memory", "0x"], "--device-memory 0x: the multiple must"),
        (["replay", EXAMPLE, "--device-memory", "1TB"], "'1TB' is ambiguous"),
        (["replay", EXAMPLE, "--device-memory", "lots"], "--device-memory: not a size: 'lots'"),
        # A forgotten x, or a size meant in GiB: never a cap of 1 or 80 bytes.
        (["replay", EXAMPLE, "--device-memory", "1.03"],
         "--device-memory 1.03: no unit; did you mean 1.03x (1.03 × the trace's peak requested "
         "bytes) or 1.03G?"),
        (["replay", EXAMPLE, "--device-memory", "80"], "or 80G? (bytes are written 80B)"),
        (["replay", EXAMPLE, "--device-memory", "1.5B"], "'1.5B': a number of bytes is whole"),
        (["replay", EXAMPLE, "--device-memory", "16EiB"], "not a size: '16EiB'"),
        (["replay", EXAMPLE, "--device-memory", "16777216T"], "more than any device holds"),
        (["tune", EXAMPLE, "--device-memory", "1.03"], "did you mean 1.03x"),
        (["replay", EXAMPLE, "--memory-fraction", "2"], "--memory-fraction: 2: a share"),
        (["replay", EXAMPLE, "--costs", "/nonexistent/costs.json"],
         "--costs /nonexistent/costs.json: cannot read it: No such file or directory"),
        (["replay", EXAMPLE, "--config", "native,"],
         "invalid allocator settings 'native,': it ends with ','"),
        (["replay", EXAMPLE, "--device", "7"], "no trace for device 7"),
        (["tune", "/nonexistent/trace.pickle"], "cannot read /nonexistent/trace.pickle"),
        (["tune", EXAMPLE, "--device-memory", "80GB"], "'80GB' is ambiguous"),
        (["tune", EXAMPLE, "--plot", "/nonexistent/dir/x.png"],
         "there is no directory /nonexistent/dir"),
        (["tune", EXAMPLE, "--memory-fraction", "0"], "--memory-fraction: 0: a share"),
        (["run"], "no command given"),
        (["run", "--config", "bogus:1", "--", "true"], "invalid allocator setting bogus"),
        (["run", "--", "/nonexistent/program"], "cannot run /nonexistent/program"),
        (["run", "--target", "bogus", "--", "true"],
         "--target: 'bogus': expected unix:///path/agent.sock or HOST:PORT"),
        (["run", "--target", "localhost:0", "--", "true"], "the port must be 1-65535"),
        (["run", "--config", "native,garbage_collection_threshold:0.8 max_split_size_mb:64",
          "--", "true"], "a space between '0.8' and 'max_split_size_mb'"),
        (["native"], "the following arguments are required: action"),
        (["native", "bogus"], "argument action: invalid choice: 'bogus'"),
        (["ctl"], "the following arguments are required: COMMAND"),
        (["ctl", "bogus"], "invalid choice: 'bogus'"),
        (["ctl", "--admin", UNREACHABLE, "agents"], "cannot reach the sidecar's admin API at "
         + UNREACHABLE),
        (["ctl", "--admin", "ftp://example", "agents"], "--admin 'ftp://example': expected"),
        (["ctl", "--rank", "zero", "agents"], "--rank: invalid int value: 'zero'"),
        (["ctl", "--timeout", "0", "agents"], "--timeout: 0: give a number of seconds above 0"),
        (["ctl", "--admin", "http://127.0.0.1:1", "--token-file", "/nonexistent/token",
          "agents"], "--token-file /nonexistent/token: No such file or directory"),
        (["ctl", "--admin", "http://127.0.0.1:1", "--token-file", "/dev/null", "agents"],
         "--token-file /dev/null: the file is empty"),
        (["ctl", "set"], "the following arguments are required: settings"),
        (["ctl", "--admin", UNREACHABLE, "set", "expandable_segments:True max_split_size_mb:64"],
         "a space between 'True' and 'max_split_size_mb' (settings are separated by ',')"),
        (["ctl", "--admin", UNREACHABLE, "set", "native,"], "it ends with ','"),
        (["ctl", "--admin", UNREACHABLE, "reclaim", "--all"], "cannot reach"),
        (["ctl", "--admin", UNREACHABLE, "snapshot", "-o", "/nonexistent/dir/x.gz"],
         "-o /nonexistent/dir/x.gz: there is no directory /nonexistent/dir"),
        (["ctl", "--admin", UNREACHABLE, "reset-peaks"], "cannot reach"),
        (["ctl", "record-history"], "the following arguments are required: state"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "begin"],
         "argument state: invalid choice: 'begin'"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "start", "--max-entries", "-1"],
         "--max-entries: -1: give a whole number from 1 to 10,000,000"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "start", "--max-entries", "0"],
         "--max-entries: 0: give a whole number from 1 to 10,000,000"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "stop", "--max-entries", "5"],
         "--max-entries goes with start"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "start", "--max-entries", "many"],
         "--max-entries: not a whole number: 'many'"),
        (["ctl", "--admin", UNREACHABLE, "record-history", "stop"], "cannot reach"),
        (["ctl", "--admin", UNREACHABLE, "diagnose", "--window", "-1"],
         "--window: -1: give a number of seconds above 0"),
        (["ctl", "--admin", UNREACHABLE, "diagnose", "--window", "0"],
         "--window: 0: give a number of seconds above 0"),  # no rate from one reading
        (["ctl", "--admin", UNREACHABLE, "diagnose"], "cannot reach"),
    ]


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's refusals
        return int(exit.code or 0)


CASES = _cases(Path("sidecar.yaml"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[0]) for c in CASES])
def test_bad_arguments_are_refused_with_a_message_naming_them(
        index: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sidecar.yaml").write_text(BAD_YAML)
    argv, named = _cases(tmp_path / "sidecar.yaml")[index]
    status = _run(argv)
    captured = capsys.readouterr()
    assert status != 0, captured.out
    assert "Traceback" not in captured.out + captured.err
    assert named in captured.err, captured.err


def test_every_subcommand_and_every_ctl_subcommand_is_tried() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    tried = {c[0][0] for c in CASES}
    assert set(commands) <= tried, set(commands) - tried
    tried_ctl = {word for argv, _ in CASES if argv[0] == "ctl" for word in argv[1:]}
    assert set(SUBCOMMANDS) <= tried_ctl, set(SUBCOMMANDS) - tried_ctl


def test_plot_without_matplotlib_names_the_plot_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    # matplotlib is installed here: hide it, as a machine without the `plot` extra has none.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for command in ("replay", "tune"):
        assert _run([command, EXAMPLE, "--plot", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert "matplotlib, which is not installed (pip install matplotlib: what the extra " \
            "'allocwatch[plot]' adds)" in err
        assert not (tmp_path / "x.png").exists()
