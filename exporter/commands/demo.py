"""allocwatch demo: a sidecar, a workload whose agent publishes to it, and a live summary.

The workload runs in a child process (as a training job would, beside the sidecar):
- "gpu": a PyTorch loop on CUDA with variable-sized activations, PyTorch's allocator as source;
- "sim": allocwatch's allocator on the simulated device replaying, in a loop, the trace that
  ships with the project (allocator_ext/data/example_trace.pickle.gz), or a synthetic
  transformer-like pattern where that file is absent.
The summary is read back from the sidecar's /metrics, so it shows what Prometheus would see.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXAMPLE_TRACE = Path(__file__).resolve().parents[2] / "allocator_ext" / "data" / \
    "example_trace.pickle.gz"
GiB = float(1 << 30)
MiB = 1 << 20

HELP = "start a sidecar and a training workload publishing to it; print a live summary"
DESCRIPTION = """\
Starts a sidecar (temporary Unix socket, metrics on --port) and a training workload whose agent
publishes to it: a real PyTorch loop where a CUDA GPU is present, otherwise allocwatch's
allocator on the simulated device replaying, in a loop, the trace that ships with the project.
Prints where the metrics are, then one line a second (reserved, allocated, fragmentation,
retries) read back from /metrics, until --duration ends."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, metavar="S",
                        help="seconds to run (default 30)")
    parser.add_argument("--port", type=int, default=9471,
                        help="metrics port (default 9471; 0: any free port)")
    parser.add_argument("--workload", choices=("auto", "gpu", "sim"), default="auto",
                        help="auto (default): gpu where torch sees CUDA, else sim")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_demo(duration=args.duration, port=args.port, workload=args.workload)


# ---------------------------------------------------------------------- simulated workload

def _trace_events(path: Path) -> list[tuple[str, int, int, int]]:
    """The example trace's allocations and frees, read with the replay's safe reader."""
    from allocator_ext.replay.trace import allocs_and_frees, load_trace

    return allocs_and_frees(load_trace(path))


def _synthetic_events(steps: int = 20, seed: int = 0) -> list[tuple[str, int, int, int]]:
    """A training-like pattern: weights kept, activations of a random batch size per step."""
    rng = random.Random(seed)
    events: list[tuple[str, int, int, int]] = []
    addr = iter(range(1, 1 << 40))
    for _ in range(8):  # weights and optimiser state: allocated once, kept
        events.append(("alloc", next(addr), rng.choice([4, 16, 64]) * MiB, 0))
    for _ in range(steps):
        tokens = rng.randint(256, 4096)
        live = []
        for _layer in range(12):
            for size in (tokens * 4096, tokens * 16384, rng.randint(1, 2000) * 512):
                a = next(addr)
                events.append(("alloc", a, size, 0))
                live.append((a, size))
        for a, size in reversed(live):
            events.append(("free_requested", a, size, 0))
    return events


def run_sim_workload(allocator: Any, stop_event: threading.Event, *,
                     trace: Path | None = EXAMPLE_TRACE, pace_seconds: float = 0.02) -> int:
    """Replay the example trace through `allocator` in a loop until stop_event; passes done.

    Each pass frees whatever it still holds at its end, so passes repeat the same pattern on an
    allocator that keeps its cache (like the steps of a training run).
    """
    events = _trace_events(trace) if trace is not None and trace.exists() else _synthetic_events()
    passes = 0
    chunk = max(1, len(events) // 100)  # ~100 pauses a pass: figures move while we watch
    while not stop_event.is_set():
        live: dict[int, int] = {}
        for i, (action, addr, size, stream) in enumerate(events):
            if action == "alloc":
                try:
                    live[addr] = allocator.malloc(size, stream)
                except MemoryError:
                    pass  # counted by the allocator (num_ooms): the demo carries on
            else:
                ptr = live.pop(addr, None)
                if ptr is not None:
                    allocator.free(ptr)
            if i % chunk == 0:
                allocator.process_events()
                if stop_event.wait(pace_seconds):
                    break
        for ptr in live.values():
            allocator.free(ptr)
        passes += 1
    return passes


def _sim_child(target: str, duration: float) -> int:
    import allocator_ext as ae
    from allocator_ext.agent import start_agent

    stop = _stop_event_on_signals(duration)
    device = ae.SimDevice(capacity=0)
    allocator = ae.Allocator(device)
    agent = start_agent(target, interval=0.5, source={0: allocator},
                        identity={"training_job": "allocwatch-demo"}, nvml=False)
    try:
        run_sim_workload(allocator, stop)
    finally:
        agent.stop()
    return 0


def _gpu_child(target: str, duration: float) -> int:
    import torch

    from allocator_ext.agent import start_agent

    stop = _stop_event_on_signals(duration)
    device = torch.device("cuda", 0)
    torch.cuda.init()
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
    optimiser = torch.optim.AdamW(model.parameters())
    agent = start_agent(target, interval=0.5, source="pytorch",
                        identity={"training_job": "allocwatch-demo"})
    rng = random.Random(0)
    try:
        while not stop.is_set():
            batch = rng.randint(64, 4096)  # variable shapes: what fragments a caching allocator
            x = torch.randn(batch, 2048, device=device)
            loss = model(x).square().mean()
            loss.backward()
            optimiser.step()
            optimiser.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
    finally:
        agent.stop()
    return 0


def _stop_event_on_signals(duration: float) -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Timer(duration, stop.set).start()
    return stop


# ---------------------------------------------------------------------- the demo itself

def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _summary(url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = {
        "torch_cuda_allocator_reserved_bytes": "reserved",
        "torch_cuda_allocator_allocated_bytes": "allocated",
        "torch_cuda_allocator_alloc_retries_total": "retries",
        "torch_cuda_allocator_ooms_total": "ooms",
        "torch_cuda_allocator_peak_reserved_bytes": "peak_reserved",
        "allocwatch_agents_connected": "agents",
        "allocwatch_reports_received_total": "reports",
    }
    figures = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and "pool" not in sample.labels:
                figures[wanted[sample.name]] += sample.value
    return figures


def _format(figures: dict[str, float], elapsed: float) -> str:
    reserved, allocated = figures["reserved"], figures["allocated"]
    frag = (reserved - allocated) / reserved if reserved else 0.0
    return (f"[{elapsed:5.1f}s] reserved {reserved / GiB:7.3f} GiB  allocated "
            f"{allocated / GiB:7.3f} GiB  fragmentation {frag:6.1%}  retries "
            f"{int(figures['retries'])}  OOMs {int(figures['ooms'])}  agents "
            f"{int(figures['agents'])}  reports {int(figures['reports'])}")


def run_demo(duration: float = 30.0, port: int = 9471, workload: str = "auto",
             out: Any = None) -> int:
    from exporter.logs import configure_logging
    from exporter.sidecar.app import SidecarThread
    from exporter.sidecar.config import (
        AgentsConfig,
        LoggingConfig,
        MetricsConfig,
        NvmlConfig,
        SidecarConfig,
    )

    out = out or sys.stdout
    if workload == "auto":
        workload = "gpu" if _gpu_available() else "sim"
    configure_logging("warning", "text")  # the demo's own lines are the output
    with tempfile.TemporaryDirectory(prefix="allocwatch-demo-") as tmp:
        config = SidecarConfig(
            agents=AgentsConfig(unix_socket=str(Path(tmp) / "agent.sock")),
            metrics=MetricsConfig(address="127.0.0.1", port=port),
            # The simulated workload has no GPU: spare the user NVML's warning.
            nvml=NvmlConfig(enabled=workload == "gpu"),
            logging=LoggingConfig(level="warning", format="text"))
        try:
            sidecar = SidecarThread(config).start()
        except OSError as err:
            print(f"allocwatch demo: cannot start the sidecar: {err} "
                  "(another program on that port? try --port 0)", file=sys.stderr)
            return 1
        url = sidecar.sidecar.metrics_url
        target = sidecar.sidecar.agent_targets[0]
        print(f"allocwatch demo: {workload} workload for {duration:g} s", file=out)
        print(f"  metrics:  {url}/metrics   (agents: {url}/)", file=out)
        print(f"  agents connect to {target}", file=out, flush=True)
        child = subprocess.Popen(
            [sys.executable, "-m", "exporter.commands.demo", "--child", workload,
             "--target", target, "--duration", str(duration)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        started = time.monotonic()
        status = 0
        try:
            for _tick in _every_second(started, duration):
                if child.poll() is not None:
                    print(f"allocwatch demo: the workload exited with status {child.returncode}",
                          file=out)
                    status = child.returncode or 1
                    break
                try:
                    line = _format(_summary(url), time.monotonic() - started)
                except OSError as err:
                    line = f"(metrics not readable: {err})"
                print(line, file=out, flush=True)
        except KeyboardInterrupt:
            status = 130
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            sidecar.stop()
        print("allocwatch demo: done", file=out, flush=True)
        return status


def _every_second(started: float, duration: float) -> Iterator[int]:
    tick = 0
    while time.monotonic() - started < duration:
        tick += 1
        time.sleep(max(0.0, started + tick - time.monotonic()))
        yield tick


def _child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the demo's workload process (internal)")
    parser.add_argument("--child", choices=("gpu", "sim"), required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--duration", type=float, required=True)
    args = parser.parse_args(argv)
    if args.child == "gpu":
        return _gpu_child(args.target, args.duration)
    return _sim_child(args.target, args.duration)


if __name__ == "__main__":
    sys.exit(_child_main())
