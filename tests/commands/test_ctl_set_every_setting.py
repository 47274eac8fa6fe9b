"""`allocwatch ctl set` reaches every key of the allocator's settings table: through a real
sidecar's admin API and an agent over allocwatch's core (simulated device), each value of each
key changes that key only; each bad value is refused (exit 2) naming the key and the value, and
changes nothing. The keys and values come from the table (tests/support/settings_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.control import connect_agent, start_control_sidecar
from support.settings_cases import ROWS, bad_values, busy_settings, good_values

from allocator_ext import _core
from exporter.cli import main

pytestmark = pytest.mark.timeout(120)


def test_every_setting_through_ctl_set(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    running = start_control_sidecar(tmp_path)
    allocator = _core.Allocator(_core.SimDevice(), busy_settings())
    agent = connect_agent(running, tmp_path, {0: allocator})
    (address,) = running.sidecar.admin.addresses()

    def items() -> dict[str, str]:
        return dict(_core.config_items(allocator.config_string()))

    try:
        for row in ROWS:
            key = row["key"]
            for value, _ in good_values(row):
                before = items()
                assert main(["ctl", "--admin", address, "set", f"{key}:{value}"]) == 0, \
                    capsys.readouterr().err
                after = items()
                assert after[key] == dict(_core.config_items(f"native,{key}:{value}"))[key]
                assert {k: v for k, v in after.items() if k != key} == \
                    {k: v for k, v in before.items() if k != key}, key
            before = items()
            for value, named in bad_values(row):
                capsys.readouterr()
                assert main(["ctl", "--admin", address, "set", f"{key}:{value}"]) == 2, value
                assert named in capsys.readouterr().err, (key, value)
                assert items() == before, (key, value)
    finally:
        agent.stop()
        running.stop()
