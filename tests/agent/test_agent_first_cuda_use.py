"""The agent starts at a process's first CUDA use, not at its import of torch: under
`allocwatch run`, a launcher that imports torch and starts the trainer (as `accelerate launch`
does) and the DataLoader workers the trainer starts with `spawn` (which import torch and never
touch CUDA) start no agent and never import it; the trainer starts one when it first uses CUDA,
and only that one reaches the sidecar.

Real processes and a real sidecar. This machine has no GPU and a CPU build of torch, so the
trainer's first CUDA use goes through a test double of CUDA's initialisation alone
(`initialise_cuda_without_a_gpu` below): torch's driver calls answer as on a one-GPU machine, and
PyTorch's own lazy initialisation (torch.cuda._lazy_init, the path every first CUDA use takes)
runs the calls queued on it, as on a GPU. On a GPU the same runs without the double
(tests/agent/test_agent_torch_gpu.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.environment import without_allocwatch
from support.paths import REPO
from support.sidecar import samples, start_sidecar
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

# What each process says of itself at its end: whether it imported the agent, and started one.
STATE = textwrap.dedent("""\
    def agent_state(role):
        import os, sys
        agent = sys.modules.get("allocator_ext.agent")
        started = agent is not None and agent._env_agent is not None
        return f"{role} {os.getpid()} imported={agent is not None} started={started}"
    """)

LAUNCHER = STATE + textwrap.dedent("""\
    import subprocess, sys
    import torch  # as accelerate launch and DeepSpeed's runner do, before starting the trainer

    code = subprocess.run([sys.executable, sys.argv[1], sys.argv[2]]).returncode
    print(agent_state("launcher"), flush=True)
    sys.exit(code)
    """)

TRAINER = STATE + textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader, Dataset


    class Items(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return agent_state("worker")  # CPU work only, as a DataLoader worker's


    def initialise_cuda_without_a_gpu():
        \"\"\"The test double: CUDA's driver calls, answered as on a one-GPU machine. PyTorch's
        torch.cuda._lazy_init itself runs unchanged, the calls queued on it included.\"\"\"
        cuda = torch.cuda
        torch._C._cuda_getDeviceCount = lambda: 1
        torch._C._cuda_init = lambda: None
        cuda._cudart = object()
        # PyTorch's own queued checks ask the GPU for its capability: there is none to ask.
        cuda._queued_calls[:] = [call for call in cuda._queued_calls
                                 if getattr(call[0], "__module__", "") != "torch.cuda"]
        cuda.init()


    if __name__ == "__main__":
        loader = DataLoader(Items(), batch_size=None, num_workers=2,
                            multiprocessing_context="spawn", persistent_workers=False)
        for line in loader:
            print(line, flush=True)
        print(agent_state("trainer-before-cuda"), flush=True)
        initialise_cuda_without_a_gpu()
        agent = sys.modules["allocator_ext.agent"]._env_agent
        deadline = time.monotonic() + 60
        while not agent.connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(agent_state("trainer"), "connected", agent.connected.is_set(), flush=True)
        stop = Path(sys.argv[1])
        while not stop.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    """)


def _states(stdout: str) -> dict[str, list[tuple[int, str]]]:
    found: dict[str, list[tuple[int, str]]] = {}
    for line in stdout.splitlines():
        role, pid, *rest = line.split()
        found.setdefault(role, []).append((int(pid), " ".join(rest)))
    return found


def test_only_the_process_that_uses_cuda_starts_an_agent(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "trainer.py").write_text(TRAINER)
    stop = tmp_path / "stop"
    env = without_allocwatch(ALLOCWATCH_TARGET=sidecar.sidecar.agent_targets[0],
                             ALLOCWATCH_INTERVAL="0.1", ALLOCWATCH_AGENT_NVML="0",
                             CUDA_VISIBLE_DEVICES="")
    run = subprocess.Popen([sys.executable, "-m", "exporter.cli", "run", "--", sys.executable,
                            str(tmp_path / "launcher.py"), str(tmp_path / "trainer.py"),
                            str(stop)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=env)
    seen: set[str] = set()
    try:
        def trainer_published() -> bool:
            for (name, labels), _ in samples(url).items():
                if name == "torch_cuda_allocator_info":
                    seen.add(dict(labels)["pid"])
            return bool(seen) or run.poll() is not None

        wait_for(trainer_published, timeout=120, interval=0.2, what="an agent in the sidecar")
        time.sleep(1.0)  # any other process's agent would show by now
        trainer_published()
        stop.touch()
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        sidecar.stop()
    assert run.returncode == 0, err[-3000:]
    states = _states(out)
    # The launcher and both spawned workers imported torch under allocwatch run, and nothing
    # of the agent.
    assert states["launcher"] == [(states["launcher"][0][0], "imported=False started=False")]
    workers = states["worker"]
    assert len({pid for pid, _ in workers}) == 2, workers
    assert all(state == "imported=False started=False" for _, state in workers), workers
    # The trainer neither, until its first CUDA use; then its agent started and connected.
    assert states["trainer-before-cuda"][0][1] == "imported=False started=False"
    [(trainer, state)] = states["trainer"]
    assert state == "imported=True started=True connected True", (state, err[-3000:])
    assert seen == {str(trainer)}, (seen, states)
