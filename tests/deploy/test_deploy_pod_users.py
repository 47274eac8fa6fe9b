"""The example Job's pod, run here under the users its rendered manifest gives: the sidecar as
65532:65532 (no supplementary group, its securityContext), the trainer as root (its image's
user), one shared emptyDir between them. The agent connects; a snapshot is taken from the
sidecar's side (`kubectl exec -c allocwatch-sidecar -- allocwatch ctl snapshot`, as 65532),
downloaded, and replayed, and `ctl diagnose --replay` does the same. Before the sidecar made
the snapshot directory, the trainer wrote it as root:root 0750 and the download was refused
(409, Permission denied)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import REPO
from support.pod import LocalPod, setpriv, stop
from support.waiting import wait_for

from bench.lib.ports import free_port

pytest.importorskip("allocator_ext", reason="allocator_ext is not built")
pytestmark = pytest.mark.timeout(240)

TRAIN = Path(__file__).with_name("train_sim.py")
SIDECAR_UID = 65532


@pytest.fixture
def pod() -> Iterator[LocalPod]:
    setpriv()
    # Not pytest's tmp_path: it lies under a root-only directory the sidecar's user cannot reach.
    root = Path(tempfile.mkdtemp(prefix="allocwatch-pod-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield LocalPod(root / "volumes", "job", metrics_port=free_port())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_snapshot_is_taken_downloaded_and_replayed_under_the_manifests_users(
        pod: LocalPod) -> None:
    assert pod.user(pod.sidecar) == (SIDECAR_UID, SIDECAR_UID) and pod.user(pod.trainer) is None
    work = pod.root.parent
    sidecar = pod.start(pod.sidecar, pod.argv(pod.sidecar), cwd=work)
    trainer = None
    try:
        socket = pod.sidecar_dir() / "agent.sock"
        wait_for(lambda: socket.exists() or sidecar.poll() is not None, timeout=30,
                 what="the sidecar's socket")
        assert sidecar.poll() is None, stop(sidecar)
        stop_file = work / "stop"
        argv = pod.argv(pod.trainer, replace={
            "--nproc-per-node=8": "--nproc-per-node=1",
            "train.py": [str(TRAIN), "--seconds", "120", "--stop-file", str(stop_file)]})
        assert argv[:5] == [sys.executable, "-m", "exporter.cli", "run", "--"]
        trainer = pod.start(pod.trainer, argv, cwd=work)

        def simulated_agent() -> str | None:
            out = pod.ctl("agents", "--json")
            agents = json.loads(out.stdout)["agents"] if out.returncode == 0 else []
            found = [a["agent"] for a in agents
                     if a["connected"] and a["backend"] == "allocwatch" and a["devices"]]
            return found[0] if found else None

        agent = wait_for(simulated_agent, timeout=90, interval=0.5, what="the trainer's agent")
        time.sleep(1.0)  # a few steps of history

        # Into the sidecar's own scratch (its root filesystem is read-only), then `kubectl cp`.
        out_file = Path(pod.host_path(pod.sidecar, "/tmp/snapshot.pickle.gz"))
        taken = pod.ctl("snapshot", "--agent", agent, "-o", str(out_file))
        assert taken.returncode == 0, taken.stdout + taken.stderr
        assert out_file.stat().st_size > 0

        # written by root, readable by the sidecar's group, in the directory the sidecar made
        directory = pod.sidecar_dir() / "snapshots"
        info = directory.stat()
        assert info.st_uid == SIDECAR_UID and info.st_mode & stat.S_ISGID
        [written] = [p for p in directory.iterdir() if p.name.endswith(".pickle.gz")]
        info = written.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, SIDECAR_UID, 0o640)

        replayed = subprocess.run([sys.executable, "-m", "exporter.cli", "replay", str(out_file),
                                   "--json"], capture_output=True, text=True, cwd=REPO,
                                  timeout=120)
        assert replayed.returncode == 0, replayed.stderr
        result = json.loads(replayed.stdout)
        assert result["events_replayed"] > 10 and result["peak_reserved_bytes"] > 0

        # `ctl diagnose --replay` takes a snapshot of its own through the same download.
        diagnosed = pod.ctl("diagnose", "--agent", agent, "--window", "0.5", "--replay")
        assert diagnosed.returncode == 0, diagnosed.stdout + diagnosed.stderr
        [step] = [line for line in diagnosed.stdout.splitlines() if "snapshot: " in line]
        assert "snapshot: replayed under " in step and "peak reserved " in step, diagnosed.stdout

        stop_file.touch()
        assert trainer.wait(timeout=60) == 0
    finally:
        logs = stop(sidecar) + (stop(trainer) if trainer is not None else "")
        print(logs)
