"""The long fault run: a multi-stream training loop under allocwatch's allocator, data checked
every step, while the sidecar it reports to is killed (SIGKILL) and restarted again and again.

    python -m bench.gpu.gpu_soak --minutes 10 --kill-every 60 --json OUT.json    (on a GPU)
    python -m bench.gpu.gpu_soak --self-check                            (CPU: the plumbing)

The worker produces a buffer on the main stream, consumes it on a side stream after
record_stream and frees it while the consumer may still run, then checks the consumer's sum;
any reuse of memory still in use shows up as a wrong sum. It reports corrupt steps (must be 0),
the median and longest step (a stall shows as a step far beyond the median), and what its
agent saw (reconnects, dropped reports). The driver kills and restarts the sidecar, and after
each restart waits for the agent to be back in /metrics with counters that did not go back.
With --self-check the worker runs on the CPU and publishes allocwatch's core on the simulated
device: it checks this script, not the GPU. It stops once the sidecar has been killed twice and
the agent was back after each, however long the worker took to start (--kills N does the same
on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import REPO
from bench.lib.sidecar_process import SidecarProcess, scrape

# ------------------------------------------------------------------------------- the worker

def worker(target: str, seconds: float, self_check: bool, stop_file: str | None) -> int:
    import torch

    import allocator_ext
    from allocator_ext.agent import start_agent

    if self_check:
        dev = allocator_ext.SimDevice()
        sim = allocator_ext.Allocator(dev)
        agent = start_agent(target, interval=0.5, source=sim, nvml=False)
    else:
        assert allocator_ext.install(), "allocwatch's allocator did not install"
        agent = start_agent(target, interval=1.0, source="allocwatch")
    device = "cpu" if self_check else "cuda"
    side = None if self_check else torch.cuda.Stream()
    n = 1 << 22
    corrupt = steps = 0
    times = []
    end = time.monotonic() + seconds
    stop = Path(stop_file) if stop_file else None
    while time.monotonic() < end and not (stop and stop.exists()):
        t0 = time.perf_counter()
        value = float(steps % 1000)
        x = torch.full((n,), value, device=device)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000)
                total = x.sum()
            x.record_stream(side)
            del x
            y = torch.full((n,), -1.0, device=device)  # would overwrite x if reused too early
            side.synchronize()
            del y
        else:
            total = x.sum()
            p = sim.malloc(n * 4)                     # keep the published allocator busy
            sim.free(p)
        if total.item() != value * n:
            corrupt += 1
        steps += 1
        times.append(time.perf_counter() - t0)
    agent.stop(2.0)
    print(json.dumps({"steps": steps, "corrupt_steps": corrupt,
                      "median_step_s": statistics.median(times), "max_step_s": max(times),
                      "agent_reconnects": agent.reconnects, "agent_dropped": agent.dropped}),
          flush=True)
    return 0


# ------------------------------------------------------------------------------- the driver

def allocations_total(url: str) -> float | None:
    return next((value for name, _, value in scrape(url, timeout=2) or []
                 if name == "torch_cuda_allocator_allocations_total"), None)


def wait_for_agent(url: str, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = allocations_total(url)
        if value is not None:
            return value
        time.sleep(0.2)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=60.0, metavar="S")
    p.add_argument("--kills", type=int, metavar="N",
                   help="stop once the sidecar was killed N times, the agent waited for after "
                        "each (--minutes then bounds the run)")
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--worker", metavar="TARGET", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.self_check and args.minutes == 10.0:
        # Two kills, two seconds apart, whenever the worker is up (seconds on a loaded machine).
        args.minutes, args.kill_every, args.kills = 2.0, 2.0, args.kills or 2
    if args.worker:
        return worker(args.worker, args.minutes * 60, args.self_check, args.stop_file)

    sidecar = SidecarProcess("allocwatch-soak-", agents_yaml="  expiry_seconds: 120\n",
                             extra_yaml="admin:\n  enabled: false\n").start()
    url = sidecar.metrics_url
    stop_file = sidecar.folder / "stop"
    cmd = [sys.executable, "-m", __spec__.name, "--worker", sidecar.target, "--minutes",
           str(args.minutes), "--stop-file", str(stop_file)]
    if args.self_check:
        cmd.append("--self-check")
    work = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    # No kill so late that the worker could end before its agent is back: that would count as
    # an agent that never returned (the worker's clock starts after this one, so this is safe).
    last_kill_at = time.monotonic() + args.minutes * 60 - min(30.0, 1.5 * args.kill_every)
    kills = 0
    back_within: list[float] = []
    went_back = 0
    last = wait_for_agent(url, 60) or 0.0
    next_kill = time.monotonic() + args.kill_every
    while work.poll() is None:
        time.sleep(0.2)
        if args.kills is not None and kills >= args.kills:
            stop_file.touch()  # the kills done, the agent waited for after each: enough
            continue
        if time.monotonic() < next_kill or time.monotonic() > last_kill_at:
            continue
        sidecar.kill()
        kills += 1
        time.sleep(1.0)
        sidecar.start()
        t0 = time.monotonic()
        value = wait_for_agent(url, 30)
        if value is not None:
            back_within.append(time.monotonic() - t0)
            if value < last:
                went_back += 1
            last = value
        next_kill = time.monotonic() + args.kill_every
    out, _ = work.communicate()
    sidecar.stop()
    result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": "no output"}
    result.update({
        "command": " ".join(sys.argv), "minutes": args.minutes, "sidecar_kills": kills,
        "agent_back_after_restart": len(back_within),
        "slowest_return_s": max(back_within) if back_within else None,
        "counters_went_back": went_back, "worker_exit": work.returncode,
    })
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = (work.returncode == 0 and result.get("corrupt_steps") == 0 and went_back == 0
          and len(back_within) == kills)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
