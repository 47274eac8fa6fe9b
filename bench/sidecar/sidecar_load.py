"""Load on one sidecar: N agents reporting R times a second, scraped every S seconds.

Prints scrape latency (p50, p99, max), reports lost (sent by agents but never received while the
sidecar was up: must be 0), reports dropped by agents, the sidecar's CPU seconds and RSS at start
and end. With --duration 600 it is the sidecar's 10-minute soak.

    python bench/sidecar/sidecar_load.py                       # 64 agents, 10/s, 30 s
    python bench/sidecar/sidecar_load.py --duration 600 --json # the soak

The sidecar runs as its own process (`allocwatch sidecar`), so its CPU time is its own; agents run
in --workers processes (the real agent code, each with a synthetic source whose counters grow).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class SyntheticSource:
    """A busy allocator's figures: counters grow, gauges move, every sample."""

    backend = "allocwatch"

    def __init__(self, device: int) -> None:
        self.device = device
        self.n = 0
        self.lock = threading.Lock()

    def devices(self) -> list[int]:
        return [self.device]

    def memory_stats(self, device: int) -> dict[str, int]:
        with self.lock:
            self.n += 1
            n = self.n
        stats = {}
        for pool in ("all", "small_pool", "large_pool"):
            for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
                        "inactive_split_bytes"):
                stats[f"{key}.{pool}.current"] = (n * 4096) % (1 << 34)
                stats[f"{key}.{pool}.peak"] = 1 << 34
            stats[f"segment.{pool}.current"] = n % 1000
        stats.update(num_alloc_retries=n // 100, num_device_alloc=n // 10,
                     num_device_free=n // 11, **{"allocation.all.allocated": n * 50})
        return stats

    def settings(self, device: int):
        from allocator_ext.agent import convert

        return convert.allocator_settings({"garbage_collection_threshold": 0.8}, "")

    def set_config(self, settings: str) -> None: ...
    def reclaim(self, device: int, empty_cache: bool) -> int:
        return 0
    def reset_peaks(self, device: int) -> None: ...
    def snapshot(self, device: int) -> dict:
        return {}
    def versions(self) -> tuple[str, str]:
        return "", ""
    def gpu_uuid(self, device: int) -> str:
        return f"GPU-bench-{device:04d}"


def worker(target: str, first_rank: int, count: int, rate: float, duration: float) -> None:
    """Run `count` agents for `duration` seconds; print their totals as JSON."""
    from allocator_ext.agent import start_agent

    agents = [start_agent(target, interval=1.0 / rate, source=SyntheticSource(rank % 8),
                          identity={"rank": rank, "local_rank": rank % 8, "world_size": 64},
                          nvml=False, buffer_reports=64, stop_at_exit=False)
              for rank in range(first_rank, first_rank + count)]
    time.sleep(duration)
    stoppers = [threading.Thread(target=a.stop, args=(5.0,)) for a in agents]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    print(json.dumps({"sent": sum(a.reports_sent for a in agents),
                      "sampled": sum(a.sequence for a in agents),
                      "dropped": sum(a.dropped for a in agents),
                      "reconnects": sum(a.reconnects for a in agents)}), flush=True)


def _scrape(url: str) -> tuple[float, dict[str, float]]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    elapsed = time.perf_counter() - started
    wanted = {"allocwatch_reports_received_total", "allocwatch_agents_connected",
              "process_cpu_seconds_total", "process_resident_memory_bytes"}
    figures = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name in wanted:
                figures[sample.name] = sample.value
    return elapsed, figures


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rate", type=float, default=10.0, help="reports per second per agent")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4, help="agent processes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", nargs=5, metavar=("TARGET", "FIRST", "COUNT", "RATE", "S"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        target, first, count, rate, duration = args.worker
        worker(target, int(first), int(count), float(rate), float(duration))
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="allocwatch-load-"))
    port = _free_port()
    socket_path = tmp / "agent.sock"
    (tmp / "sidecar.yaml").write_text(textwrap.dedent(f"""\
        agents: {{unix_socket: {socket_path}}}
        metrics: {{address: 127.0.0.1, port: {port}}}
        nvml: {{enabled: false}}
        logging: {{level: warning}}
        """))
    sidecar = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                                str(tmp / "sidecar.yaml")], cwd=ROOT)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for _ in range(200):
            try:
                _, start_figures = _scrape(url)
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise SystemExit("the sidecar did not start")
        per_worker = [args.agents // args.workers + (i < args.agents % args.workers)
                      for i in range(args.workers)]
        workers, first = [], 0
        for count in per_worker:
            workers.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", f"unix://{socket_path}", str(first),
                 str(count), str(args.rate), str(args.duration)],
                stdout=subprocess.PIPE, text=True, cwd=ROOT))
            first += count
        latencies: list[float] = []
        connected_max = 0.0
        started = time.monotonic()
        while time.monotonic() - started < args.duration:
            elapsed, figures = _scrape(url)
            if time.monotonic() - started > 3:  # after the agents have all connected
                latencies.append(elapsed)
            connected_max = max(connected_max, figures.get("allocwatch_agents_connected", 0))
            time.sleep(max(0.0, args.scrape_interval - elapsed))
        totals = {"sent": 0, "sampled": 0, "dropped": 0, "reconnects": 0}
        for w in workers:
            out, _ = w.communicate(timeout=120)
            for key, value in json.loads(out.strip().splitlines()[-1]).items():
                totals[key] += value
        _, end_figures = _scrape(url)
        received = end_figures["allocwatch_reports_received_total"]
        latencies.sort()
        result = {
            "agents": args.agents, "rate_per_agent": args.rate, "duration_s": args.duration,
            "agents_connected_max": connected_max,
            "scrapes": len(latencies),
            "scrape_p50_ms": round(1000 * statistics.median(latencies), 2),
            "scrape_p99_ms": round(1000 * latencies[min(len(latencies) - 1,
                                                        int(0.99 * len(latencies)))], 2),
            "scrape_max_ms": round(1000 * latencies[-1], 2),
            "reports_sampled": totals["sampled"], "reports_sent": totals["sent"],
            "reports_received": int(received),
            "reports_lost": int(totals["sent"] - received),
            "reports_dropped_by_agents": totals["dropped"],
            "agent_reconnects": totals["reconnects"],
            "sidecar_cpu_seconds": round(end_figures["process_cpu_seconds_total"]
                                         - start_figures["process_cpu_seconds_total"], 2),
            "sidecar_cpu_share": round((end_figures["process_cpu_seconds_total"]
                                        - start_figures["process_cpu_seconds_total"])
                                       / args.duration, 3),
            "sidecar_rss_start_mib": round(
                start_figures["process_resident_memory_bytes"] / 2**20, 1),
            "sidecar_rss_end_mib": round(end_figures["process_resident_memory_bytes"] / 2**20, 1),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        }
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(10)
        except subprocess.TimeoutExpired:
            sidecar.kill()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0 if result["reports_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
