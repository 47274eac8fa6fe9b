"""A process forked from a training process (a DataLoader worker under the fork start method, a
pool's worker) inherits its parent's agent object but neither its threads nor a connection of
its own. The copy is abandoned in the child: it never touches the parent's stream, counts as
unconnected, and its exit handler returns at once instead of draining a queue nobody sends. The
parent's agent keeps its stream. gRPC's fork handlers are off by default in a process with an
agent, since its open stream would make them skip themselves and say so at every fork; a
program that chose a setting keeps it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.environment import without_allocwatch
from support.paths import REPO
from support.sidecar import start_sidecar, values
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

# The training process: its agent (from the environment) connected, then three forks whose
# children exit normally, so that the exit handlers copied from the parent run in them.
FORKING_TRAINER = textwrap.dedent("""
    import json, os, sys, time
    import allocator_ext as ae
    from allocator_ext.agent import maybe_start_from_env

    alloc = ae.Allocator(ae.SimDevice(capacity=1 << 30))
    agent = maybe_start_from_env(source=alloc)
    alloc.free(alloc.malloc(1 << 20, stream=0))
    deadline = time.monotonic() + 20
    while not agent.connected.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    children = []
    for _ in range(3):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            inherited = maybe_start_from_env(source=alloc)
            started = time.monotonic()
            # As the exit handler does (it runs again at exit, with 1 s), with a timeout long
            # enough to tell a drain from a loaded machine's delay.
            inherited.stop(10.0)
            seen = {"same_object": inherited is agent, "connected": inherited.connected.is_set(),
                    "stop_seconds": time.monotonic() - started}
            os.write(write_end, json.dumps(seen).encode())
            sys.exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        with os.fdopen(read_end) as pipe:
            children.append(json.loads(pipe.read()))
    time.sleep(0.5)  # a report or two after the forks
    print(json.dumps({"children": children, "connected": agent.connected.is_set(),
                      "reconnects": agent.reconnects, "last_error": agent.last_error,
                      "sequence": agent.sequence}), flush=True)
""")


def test_forked_children_abandon_their_copy_and_leave_the_parents_stream(tmp_path: Path) -> None:
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    env = without_allocwatch(ALLOCWATCH_TARGET=sidecar.sidecar.agent_targets[0],
                             ALLOCWATCH_INTERVAL="0.05", ALLOCWATCH_AGENT_NVML="0")
    try:
        out = subprocess.run([sys.executable, "-c", FORKING_TRAINER], capture_output=True,
                             text=True, env=env, cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.splitlines()[-1])
        for child in result["children"]:
            # The child's agent is the parent's object, abandoned: unconnected, and stopping it
            # waits for nothing (the parent's agent would drain for half of stop's timeout).
            assert child["same_object"] and not child["connected"], child
            assert child["stop_seconds"] < 2.0, child  # a copy not abandoned waits up to 10 s
        # The parent's stream never noticed: no reconnect, no error, and it reported on.
        assert result["connected"] and result["reconnects"] == 0, result
        assert result["last_error"] is None, result
        # gRPC said nothing about the forks.
        assert "fork" not in out.stderr, out.stderr
        # The parent said goodbye at its exit, and nothing else stayed connected (the sidecar
        # handles that goodbye on its own thread, maybe after the process is gone).
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0],
                 what="no agent connected")
    finally:
        sidecar.stop()


@pytest.mark.parametrize("chosen, expected", [(None, "false"), ("true", "true")])
def test_grpc_fork_handlers_are_off_unless_the_program_chose(chosen: str | None,
                                                             expected: str) -> None:
    env = without_allocwatch()
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    if chosen is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = chosen
    script = "import os, allocator_ext.agent; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
