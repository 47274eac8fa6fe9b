"""Load on one sidecar: N agents reporting R times a second, scraped in three phases.

1. `single`: one scraper, a scrape every --scrape-interval (--single-seconds);
2. `crowd`: --scrapers scrapers scraping together, at the same ticks (--duration);
3. `idle`: the same, while --idle-connections connections to /metrics are held open: each one
   the sidecar closes is opened again a second later (--duration).

Scrapers keep their connections alive and ask for OpenMetrics with gzip, as Prometheus does.
Per phase it prints scrape latency (p50, p99, max), scrapes that failed or timed out (must be
0), the agents' report latency (from sampling a report to handing it to gRPC: it grows when the
sidecar cannot keep up), the sidecar's CPU share and largest RSS; over the run, reports lost
(sent by agents but never received: must be 0) and dropped by agents, and the ratio the
2-core bar reads: crowd p99 / single p99 (≤ 2). A phase of 0 seconds is skipped.

    python -m bench.sidecar.sidecar_load --json                      # 30 + 60 + 60 s
    python -m bench.sidecar.sidecar_load --single-seconds 600 --duration 0 --json  # the soak

The sidecar runs as its own process (`allocwatch sidecar`), so its CPU time and RSS (read from
/proc) are its own; agents run in --workers processes (the real agent code, each agent with a
synthetic source whose counters grow); scrapers and idle connections in this process, whose
soft descriptor limit is raised as far as the hard one allows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench import REPO
from bench.lib import source_tree
from bench.lib.ports import free_port

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
SCRAPE_TIMEOUT = 5.0  # seconds; a scrape slower than this counts as timed out
REOPEN_AFTER = 1.0    # seconds before an idle connection the sidecar closed is opened again


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


# ---------------------------------------------------------------------------- agents


def worker(target: str, first_rank: int, count: int, rate: float) -> None:
    """Run `count` agents until stdin closes; print their totals and report latencies (unix
    time handed to gRPC, seconds since sampled) as JSON."""
    from allocator_ext.agent import start_agent

    agents = [start_agent(target, interval=1.0 / rate, source=SyntheticSource(rank % 8),
                          identity={"rank": rank, "local_rank": rank % 8, "world_size": 64},
                          nvml=False, buffer_reports=64, stop_at_exit=False)
              for rank in range(first_rank, first_rank + count)]
    latencies: list[tuple[float, float]] = []
    for agent in agents:
        agent.outbox.get = _timed(agent.outbox.get, latencies)  # type: ignore[method-assign]
    sys.stdin.read()
    stoppers = [threading.Thread(target=a.stop, args=(5.0,)) for a in agents]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    print(json.dumps({"sent": sum(a.reports_sent for a in agents),
                      "sampled": sum(a.sequence for a in agents),
                      "dropped": sum(a.dropped for a in agents),
                      "reconnects": sum(a.reconnects for a in agents),
                      "latencies": [[round(t, 3), round(d, 5)] for t, d in latencies]}),
          flush=True)


def _timed(get: Callable, latencies: list[tuple[float, float]]) -> Callable:
    """The outbox's get, noting how long each report waited since it was sampled (the agent's
    connection thread takes the next one when gRPC has taken the last)."""
    def timed_get(timeout: float):
        message = get(timeout)
        if message is not None and message.WhichOneof("body") == "report":
            now = time.time()
            latencies.append((now, now - message.report.timestamp_seconds))
        return message
    return timed_get


# ---------------------------------------------------------------------------- scrapers


class Scraper(threading.Thread):
    """Scrapes at the shared ticks of its phase over one kept-alive connection, as Prometheus
    does; notes each latency, and each scrape that failed or timed out."""

    def __init__(self, port: int, start: float, interval: float, end: float):
        super().__init__(daemon=True)
        self.port, self.start_at, self.interval, self.end = port, start, interval, end
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.reconnects = 0
        self.body_bytes = 0  # the last answer's, gzip-compressed
        self._conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        tick = 0
        while True:
            at = self.start_at + tick * self.interval
            now = time.monotonic()
            if at >= self.end:
                break
            if at < now:  # overran a tick: the next one still ahead
                tick += int((now - at) / self.interval) + 1
                continue
            time.sleep(at - now)
            self.scrape()
            tick += 1
        if self._conn is not None:
            self._conn.close()

    def scrape(self) -> None:
        started = time.perf_counter()
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                        timeout=SCRAPE_TIMEOUT)
            try:
                self._conn.request("GET", "/metrics", headers={
                    "Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
                response = self._conn.getresponse()
                self.body_bytes = len(response.read())
                if response.status != 200:
                    self.failures.append(f"status {response.status}")
                    return
                self.latencies.append(time.perf_counter() - started)
                return
            except (ConnectionResetError, BrokenPipeError) as err:
                self._conn.close()
                self._conn = None
                if attempt == 0:
                    self.reconnects += 1  # a kept-alive connection the sidecar closed
                    continue
                self.failures.append(type(err).__name__)
            except OSError as err:  # timed out, refused
                self._conn.close()
                self._conn = None
                self.failures.append(type(err).__name__)
            return


class IdleConnections(threading.Thread):
    """`count` connections to the port that never send a byte; each one the sidecar closes is
    opened again REOPEN_AFTER seconds later, so the sidecar always faces `count`."""

    def __init__(self, port: int, count: int):
        super().__init__(daemon=True)
        self.port, self.count = port, count
        self.opened = self.closed_by_sidecar = self.failed = 0
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()

    def _open(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", self.port))
        if err not in (0, 115):  # 115: EINPROGRESS
            sock.close()
            self.failed += 1
            return
        self.opened += 1
        self._selector.register(sock, selectors.EVENT_READ)

    def run(self) -> None:
        reopen: list[float] = [0.0] * self.count  # when each missing connection opens
        while not self._stopping.is_set():
            now = time.monotonic()
            due = [t for t in reopen if t <= now]
            reopen = [t for t in reopen if t > now]
            for _ in due:
                self._open()
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:  # closed by the sidecar
                    self._selector.unregister(sock)
                    sock.close()
                    self.closed_by_sidecar += 1
                    reopen.append(time.monotonic() + REOPEN_AFTER)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def stop(self) -> None:
        self._stopping.set()
        self.join(10)


# ---------------------------------------------------------------------------- the sidecar


class SidecarUsage:
    """The sidecar process's CPU seconds and RSS, from /proc (Linux)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._tick = os.sysconf("SC_CLK_TCK")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def _figures(port: int, wanted: set[str]) -> dict[str, float]:
    """Sums of the wanted samples, by name and labels, from one plain scrape."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in wanted:
                key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())
                                            if k in ("server", "reason"))
                figures[key] = figures.get(key, 0.0) + sample.value
    return figures


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {"p50": round(scale * statistics.median(ordered), 2),
            "p99": round(scale * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
            "max": round(scale * ordered[-1], 2)}


def run_phase(name: str, seconds: float, port: int, scrapers: int, interval: float,
              usage: SidecarUsage, idle: int) -> dict:
    holder = IdleConnections(port, idle) if idle else None
    if holder is not None:
        holder.start()
        time.sleep(3.0)  # let them open (and the sidecar start closing) before scraping
    start = time.monotonic() + 0.2
    wall_start = time.time() + 0.2
    crowd = [Scraper(port, start, interval, start + seconds) for _ in range(scrapers)]
    cpu_before = usage.cpu_seconds()
    rss_max = usage.rss_mib()
    for scraper in crowd:
        scraper.start()
    while any(s.is_alive() for s in crowd):
        rss_max = max(rss_max, usage.rss_mib())
        time.sleep(0.5)
    cpu = usage.cpu_seconds() - cpu_before
    latencies = [latency for s in crowd for latency in s.latencies]
    failures = [failure for s in crowd for failure in s.failures]
    result = {
        "phase": name, "seconds": seconds, "scrapers": scrapers,
        "wall_start": wall_start, "wall_end": wall_start + seconds,
        "scrapes": len(latencies), "scrape_ms": _percentiles(latencies),
        "scrape_failures": len(failures), "scrape_failure_kinds": sorted(set(failures)),
        "scraper_reconnects": sum(s.reconnects for s in crowd),
        "scrape_body_bytes": max(s.body_bytes for s in crowd),
        "sidecar_cpu_share": round(cpu / seconds, 3), "sidecar_rss_max_mib": round(rss_max, 1),
    }
    if holder is not None:
        held = _figures(port, {"allocwatch_http_connections"})  # the sidecar's own count
        result.update(idle_connections=idle, idle_opened=holder.opened,
                      idle_closed_by_sidecar=holder.closed_by_sidecar,
                      idle_failed_to_open=holder.failed,
                      sidecar_http_connections_at_end=held.get(
                          "allocwatch_http_connections,server=metrics"))
        holder.stop()
    return result


def wait_for_sidecar(port: int) -> None:
    """Until the sidecar's /metrics answers (10 s at most)."""
    for _ in range(200):
        try:
            _figures(port, set())
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the sidecar did not start")


def start_workers(socket_path: Path, agents: int, workers: int,
                  rate: float) -> list[subprocess.Popen]:
    """`agents` agents reporting `rate` times a second to the sidecar at `socket_path`, spread
    over `workers` worker processes of this module (ranks 0..agents-1)."""
    started = []
    first = 0
    for i in range(workers):
        count = agents // workers + (i < agents % workers)
        started.append(subprocess.Popen(
            [sys.executable, "-m", "bench.sidecar.sidecar_load", "--worker",
             f"unix://{socket_path}", str(first), str(count), str(rate)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO))
        first += count
    return started


def _raise_descriptor_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rate", type=float, default=10.0, help="reports per second per agent")
    parser.add_argument("--single-seconds", type=float, default=30.0,
                        help="seconds of the one-scraper phase")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of each crowded phase (scrapers; scrapers + idle)")
    parser.add_argument("--scrapers", type=int, default=4, help="scrapers of the crowded phases")
    parser.add_argument("--idle-connections", type=int, default=1000,
                        help="connections held open in the last phase (0: no such phase)")
    parser.add_argument("--scrape-interval", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=4, help="agent processes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", nargs=4, metavar=("TARGET", "FIRST", "COUNT", "RATE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        target, first, count, rate = args.worker
        worker(target, int(first), int(count), float(rate))
        return 0

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    descriptors = _raise_descriptor_limit(args.idle_connections + 512)
    tmp = Path(tempfile.mkdtemp(prefix="allocwatch-load-"))
    port = free_port()
    socket_path = tmp / "agent.sock"
    (tmp / "sidecar.yaml").write_text(textwrap.dedent(f"""\
        agents: {{unix_socket: {socket_path}}}
        metrics: {{address: 127.0.0.1, port: {port}}}
        nvml: {{enabled: false}}
        logging: {{level: warning}}
        """))
    # The sidecar under the machine's usual descriptor limit, whatever this process raised.
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "sidecar", "--config", str(tmp / "sidecar.yaml")],
        cwd=REPO, preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_NOFILE, (min(1024, hard), hard)))
    usage = SidecarUsage(sidecar.pid)
    workers: list[subprocess.Popen] = []
    wanted = {"allocwatch_reports_received_total", "allocwatch_agents_connected",
              "allocwatch_http_connections_closed_total", "allocwatch_agents_refused_total"}
    try:
        wait_for_sidecar(port)
        rss_start = usage.rss_mib()
        workers.extend(start_workers(socket_path, args.agents, args.workers, args.rate))
        deadline = time.monotonic() + 60
        while _figures(port, wanted).get("allocwatch_agents_connected", 0) < args.agents:
            if time.monotonic() > deadline:
                raise SystemExit("the agents did not all connect within 60 s")
            time.sleep(0.2)
        time.sleep(1.0)  # every agent past its first report
        phases = []
        for name, seconds, scrapers, idle in (
                ("single", args.single_seconds, 1, 0),
                ("crowd", args.duration, args.scrapers, 0),
                ("idle", args.duration if args.idle_connections else 0, args.scrapers,
                 args.idle_connections)):
            if seconds > 0:
                phases.append(run_phase(name, seconds, port, scrapers, args.scrape_interval,
                                        usage, idle))
        totals = {"sent": 0, "sampled": 0, "dropped": 0, "reconnects": 0}
        report_latencies: list[list[float]] = []
        for w in workers:
            out, _ = w.communicate(input="", timeout=120)
            figures = json.loads(out.strip().splitlines()[-1])
            report_latencies += figures.pop("latencies")
            for key, value in figures.items():
                totals[key] += value
        end = _figures(port, wanted)
        rss_end = usage.rss_mib()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(10)
        except subprocess.TimeoutExpired:
            sidecar.kill()
    for phase in phases:
        inside = [d for t, d in report_latencies if phase["wall_start"] <= t < phase["wall_end"]]
        phase["report_latency_ms"] = _percentiles(inside)
        phase["reports_in_phase"] = len(inside)
    by_name = {phase["phase"]: phase for phase in phases}
    received = int(end.get("allocwatch_reports_received_total", 0))

    def ratio(name: str) -> float | None:
        single = by_name.get("single", {}).get("scrape_ms", {}).get("p99")
        other = by_name.get(name, {}).get("scrape_ms", {}).get("p99")
        return round(other / single, 2) if single and other is not None else None

    result = {
        "agents": args.agents, "rate_per_agent": args.rate, "cpu_count": os.cpu_count(),
        "descriptor_limit": descriptors, "source": source_tree.label(),
        "phases": phases,
        "crowd_p99_over_single_p99": ratio("crowd"), "idle_p99_over_single_p99": ratio("idle"),
        "scrape_failures": sum(p["scrape_failures"] for p in phases),
        "reports_sampled": totals["sampled"], "reports_sent": totals["sent"],
        "reports_received": received, "reports_lost": totals["sent"] - received,
        "reports_dropped_by_agents": totals["dropped"], "agent_reconnects": totals["reconnects"],
        "sidecar_rss_start_mib": round(rss_start, 1), "sidecar_rss_end_mib": round(rss_end, 1),
        "sidecar_connections_closed": {key.split(",", 1)[1]: value for key, value in end.items()
                                       if key.startswith("allocwatch_http_connections_closed")},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    for phase in phases:
        del phase["wall_start"], phase["wall_end"]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key != "phases":
                print(f"{key:28} {value}")
        for phase in phases:
            print(json.dumps(phase))
    ok = result["reports_lost"] == 0 and result["scrape_failures"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
