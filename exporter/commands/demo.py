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
import collections
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exporter.commands._arguments import HelpFormatter, seconds, tcp_port

EXAMPLE_TRACE = Path(__file__).resolve().parents[2] / "allocator_ext" / "data" / \
    "example_trace.pickle.gz"
GiB = float(1 << 30)
MiB = 1 << 20

# The demo and its workload stop within a second of being told to (two halves: the workload's
# goodbye to the sidecar, then the sidecar).
STOP_SECONDS = 1.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

HELP = "start a sidecar and a training workload publishing to it; print a live summary"
DESCRIPTION = """\
Starts a sidecar (temporary Unix sockets, metrics on --port) and a training workload whose
agent publishes to it: a real PyTorch loop where a CUDA GPU is present, otherwise allocwatch's
allocator on the simulated device replaying, in a loop, the trace that ships with the project.
Prints where the metrics and the admin API are, with an `allocwatch ctl` line to paste into
another terminal, then one line a second read back from /metrics until --duration ends:
reserved, allocated, peak fragmentation (1 - peak allocated / peak reserved, at its lowest over
the last few seconds: what the cache strands at the peak of use), the share of the cache unused
at that moment (high between steps for any healthy cache), retries and OOMs. Ctrl-C, SIGTERM,
SIGHUP or the end of the process that started it stop the demo and its workload within a
second, and remove its temporary directory."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION,
                                   formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=seconds(), default=30.0, metavar="S",
                        help="seconds to run (default 30)")
    parser.add_argument("--port", type=tcp_port, default=9471,
                        help="metrics port (default 9471; 0: any free port)")
    parser.add_argument("--workload", choices=("auto", "gpu", "sim"), default="auto",
                        help="auto (default): gpu where torch sees CUDA, else sim")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_demo(duration=args.duration, port=args.port, workload=args.workload)


# ---------------------------------------------------------------------- simulated workload

def demo_trace(path: Path | None = EXAMPLE_TRACE) -> Any:
    """The trace the simulated workload repeats: `path`, read with the replay's safe reader, or
    the synthetic pattern where that file is absent."""
    from allocator_ext.replay.trace import load_trace

    return load_trace(path) if path is not None and path.exists() else _synthetic_trace()


def _synthetic_trace(steps: int = 20, seed: int = 0) -> Any:
    """A training-like pattern: weights kept, activations of a random batch size per step."""
    from allocator_ext.replay.trace import Trace, TraceEvent

    rng = random.Random(seed)
    addr = iter(range(1, 1 << 40))
    # One mapping the addresses lie in, so that the trace starts from an empty allocator.
    events = [TraceEvent("segment_map", 0, 1 << 40, 0, 0)]

    def add(action: str, a: int, size: int) -> None:
        events.append(TraceEvent(action, a, size, 0, len(events)))

    for _ in range(8):  # weights and optimiser state: allocated once, kept
        add("alloc", next(addr), rng.choice([4, 16, 64]) * MiB)
    for _ in range(steps):
        tokens = rng.randint(256, 4096)
        live = []
        for _layer in range(12):
            for size in (tokens * 4096, tokens * 16384, rng.randint(1, 2000) * 512):
                a = next(addr)
                add("alloc", a, size)
                live.append((a, size))
        for a, size in reversed(live):
            add("free_requested", a, size)
            add("free_completed", a, size)
    return Trace("<synthetic>", events, device=0)


class _Abandoned(Exception):
    """Ends the pass under way once the workload is told to stop."""


def run_sim_workload(replayer: Any, stop_event: threading.Event, *,
                     pace_seconds: float = 0.02) -> int:
    """Replays the replayer's trace in passes until stop_event; returns the passes done.

    Each pass frees whatever it still holds at its end, so passes repeat the same pattern on an
    allocator that keeps its cache (like the steps of a training run). Once stopped, the pass
    under way is abandoned at its next pause and what it holds freed: a stop takes effect
    within a pause, not a pass.
    """
    chunk = max(1, len(replayer.trace.events) // 100)  # ~100 pauses a pass: figures move
    steps = [0]

    def pace(_event: Any) -> None:
        steps[0] += 1
        if steps[0] % chunk == 0:
            stop_event.wait(pace_seconds)
            if stop_event.is_set():
                raise _Abandoned

    passes = 0
    while not stop_event.is_set():
        try:
            replayer.run_pass(release=True, after_step=pace)
        except _Abandoned:
            replayer.release_held()
            break
        passes += 1
    return passes


def _sim_child(target: str, stop: threading.Event) -> int:
    from allocator_ext.agent import start_agent
    from allocator_ext.replay import Replayer

    replayer = Replayer(demo_trace())  # allocwatch's defaults, on an unlimited simulated device
    agent = start_agent(target, interval=0.5, source={0: replayer.allocator},
                        identity={"training_job": "allocwatch-demo"}, nvml=False)
    try:
        run_sim_workload(replayer, stop)
    finally:
        agent.stop(timeout=STOP_SECONDS / 2)
    return 0


def _gpu_child(target: str, stop: threading.Event) -> int:
    import torch

    from allocator_ext.agent import start_agent

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
        agent.stop(timeout=STOP_SECONDS / 2)
    return 0


def _child_stop_event(duration: float) -> tuple[threading.Event, threading.Event]:
    """When the workload stops: at the end of `duration`, on SIGTERM, SIGINT or SIGHUP (the
    demo's own stop, or the terminal's), or when its standard input, a pipe that only the demo
    holds open, reaches its end: the demo is gone, however it ended (even SIGKILL). Returns
    the stop event and the event of that last case."""
    stop, orphaned = threading.Event(), threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    timer = threading.Timer(duration, stop.set)
    timer.daemon = True  # a stopped workload exits now, not when the duration ends
    timer.start()

    def watch_parent() -> None:
        # Returns at end of file: the demo's end of the pipe closed. (os.read: a buffered
        # reader's lock, held by this daemon thread, would stall the interpreter's exit.)
        while os.read(sys.stdin.fileno(), 4096):
            pass
        orphaned.set()
        stop.set()

    threading.Thread(target=watch_parent, name="demo-parent", daemon=True).start()
    return stop, orphaned


# ---------------------------------------------------------------------- the demo itself

# Asked in a process of its own: torch, once imported, would stay in the demo and make its exit
# (the interpreter's finalisation) take seconds. The working directory leaves sys.path first.
_GPU_PROBE = """
import sys
del sys.path[0]
try:
    import torch
except ImportError:
    print("torch is not installed")
else:
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA GPU")
"""


def _no_gpu_reason() -> str | None:
    """Why the GPU workload cannot run here, or None when it can."""
    probe = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True,
                           timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"torch fails to load ({last})"
    return probe.stdout.strip() or None


def _summary(url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    summed = {
        "torch_cuda_allocator_reserved_bytes": "reserved",
        "torch_cuda_allocator_allocated_bytes": "allocated",
        "torch_cuda_allocator_alloc_retries_total": "retries",
        "torch_cuda_allocator_ooms_total": "ooms",
        "allocwatch_agents_connected": "agents",
        "allocwatch_reports_received_total": "reports",
    }
    worst = {"torch_cuda_allocator_peak_fragmentation_ratio": "peak_fragmentation"}
    figures = dict.fromkeys([*summed.values(), *worst.values()], 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in summed:
                figures[summed[sample.name]] += sample.value
            elif sample.name in worst:
                figures[worst[sample.name]] = max(figures[worst[sample.name]], sample.value)
    return figures


class Headline:
    """The live line. Peak fragmentation is shown at its lowest over the last few readings: a
    report interval that missed the workload's peak of use reads higher than what the cache
    strands (as the alert takes the minimum over 15 minutes)."""

    def __init__(self, readings: int = 5):
        self._peak_fragmentation: collections.deque[float] = collections.deque(maxlen=readings)

    def line(self, figures: dict[str, float], elapsed: float) -> str:
        reserved, allocated = figures["reserved"], figures["allocated"]
        if reserved:
            self._peak_fragmentation.append(figures["peak_fragmentation"])
        # Until the readings span a few seconds (a pass of the workload), the lowest may
        # still miss the peak of use: say nothing rather than something too high.
        full = len(self._peak_fragmentation) == self._peak_fragmentation.maxlen
        peak = f"{min(self._peak_fragmentation):6.1%}" if full else f"{'-':>6s}"
        unused = (reserved - allocated) / reserved if reserved else 0.0
        return (f"[{elapsed:5.1f}s] reserved {reserved / GiB:7.3f} GiB  allocated "
                f"{allocated / GiB:7.3f} GiB  peak fragmentation {peak}  (unused now "
                f"{unused:5.1%})  retries {int(figures['retries'])}  OOMs "
                f"{int(figures['ooms'])}  agents {int(figures['agents'])}  reports "
                f"{int(figures['reports'])}")


def run_demo(duration: float = 30.0, port: int = 9471, workload: str = "auto",
             out: Any = None) -> int:
    from exporter.shared.logs import configure_logging

    out = out or sys.stdout
    no_gpu = _no_gpu_reason() if workload in ("auto", "gpu") else None
    if workload == "gpu" and no_gpu:
        print(f"allocwatch demo: --workload gpu needs a CUDA GPU, and {no_gpu}; "
              "--workload sim runs allocwatch's allocator on a simulated device instead",
              file=sys.stderr)
        return 2
    if workload == "auto":
        workload = "sim" if no_gpu else "gpu"
    configure_logging("warning", "logfmt")  # the demo's own lines are the output
    signals = _StopSignals()
    try:
        return _run(duration, port, workload, out, signals)
    except _Interrupted as stopped:
        return 128 + stopped.signum
    finally:
        signals.restore()


def _run(duration: float, port: int, workload: str, out: Any, signals: _StopSignals) -> int:
    from exporter.agents.grpc_server import ListenError
    from exporter.sidecar.app import SidecarThread
    from exporter.sidecar.config import (
        AgentsConfig,
        LoggingConfig,
        MetricsConfig,
        NvmlConfig,
        SidecarConfig,
    )

    with tempfile.TemporaryDirectory(prefix="allocwatch-demo-",
                                     ignore_cleanup_errors=True) as tmp:
        config = SidecarConfig(
            agents=AgentsConfig(unix_socket=str(Path(tmp) / "agent.sock")),
            metrics=MetricsConfig(address="127.0.0.1", port=port),
            # The simulated workload has no GPU: spare the user NVML's warning.
            nvml=NvmlConfig(enabled=workload == "gpu"),
            logging=LoggingConfig(level="warning", format="logfmt"))
        sidecar = child = None
        status = 0
        try:
            try:
                sidecar = SidecarThread(config).start()
            except (ListenError, OSError) as err:
                print(f"allocwatch demo: cannot start the sidecar: {err} "
                      "(another program on that port? try --port 0)", file=sys.stderr)
                return 1
            url = sidecar.sidecar.metrics_url
            target = sidecar.sidecar.agent_targets[0]
            admin = _admin_address(sidecar)
            print(f"allocwatch demo: {workload} workload for {duration:g} s", file=out)
            print(f"  metrics:  {url}/metrics   (agents: {url}/)", file=out)
            print(f"  agents connect to {target}", file=out)
            if admin:
                print(f"  admin API: {admin}; in another terminal, while the demo runs:",
                      file=out)
                print(f"    allocwatch ctl --admin {shlex.quote(admin)} agents", file=out)
            out.flush()
            # In the temporary directory, not the caller's: `python -m` imports from the
            # working directory first, and a checkout there is not the installed package.
            # Its standard input is a pipe only this process holds: its end is our end.
            child = subprocess.Popen(
                [sys.executable, "-m", "exporter.commands.demo", "--child", workload,
                 "--target", target, "--duration", str(duration), "--directory", tmp],
                stdin=subprocess.PIPE, cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            started = time.monotonic()
            headline = Headline()
            for _tick in _every_second(started, duration):
                if child.poll() is not None:
                    print(f"allocwatch demo: the workload exited with status "
                          f"{child.returncode}", file=out)
                    status = child.returncode or 1
                    break
                try:
                    line = headline.line(_summary(url), time.monotonic() - started)
                except OSError as err:
                    line = f"(metrics not readable: {err})"
                print(line, file=out, flush=True)
        finally:
            signals.cleaning.set()  # a second Ctrl-C must not cut the clean-up short
            if child is not None:
                _stop_child(child)
            if sidecar is not None:
                sidecar.stop()
        print("allocwatch demo: done", file=out, flush=True)
        return status


class _Interrupted(Exception):
    """A stop signal, raised in the demo's main thread."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """While installed: SIGINT, SIGTERM and SIGHUP raise _Interrupted in the main thread,
    until the clean-up began, and the end of the process that started the demo counts as
    SIGTERM. Where the demo does not run in the main thread (a caller's), signals stay the
    caller's."""

    def __init__(self) -> None:
        self.cleaning = threading.Event()
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = {sig: signal.signal(sig, self._interrupt) for sig in STOP_SIGNALS}
        threading.Thread(target=self._watch_parent, args=(os.getppid(),), name="demo-parent",
                         daemon=True).start()

    def _interrupt(self, signum: int, _frame: Any) -> None:
        if not self.cleaning.is_set():
            self.cleaning.set()
            raise _Interrupted(signum)

    def _watch_parent(self, parent: int) -> None:
        # An orphan is handed to another parent (init, or a subreaper).
        while not self._done.wait(0.1):
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def restore(self) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stop_child(child: subprocess.Popen) -> None:
    """Tells the workload to stop (it may have been told already: the terminal's SIGINT
    reaches the whole process group) and waits for it, within half the stop's time."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(STOP_SECONDS / 2 + 0.2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if child.stdin is not None:
        child.stdin.close()


def _admin_address(sidecar: Any) -> str | None:
    """The admin API's Unix socket, as `ctl --admin` takes it."""
    admin = sidecar.sidecar.admin
    addresses = admin.addresses() if admin is not None else []
    return next((a for a in addresses if a.startswith("unix://")), None)


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
    parser.add_argument("--directory", required=True,
                        help="the demo's temporary directory, removed here if the demo is gone")
    args = parser.parse_args(argv)
    stop, orphaned = _child_stop_event(args.duration)
    try:
        if args.child == "gpu":
            return _gpu_child(args.target, stop)
        return _sim_child(args.target, stop)
    finally:
        if orphaned.is_set():  # the demo could not clean up after itself: do it for it
            shutil.rmtree(args.directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_child_main())
