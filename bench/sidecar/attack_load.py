"""The sidecar under load and under attack: N agents reporting R times a second and S scrapers,
first alone (`quiet`), then (`attack`) beside a hostile client of every class the sidecar must
bound, for --seconds each:

- `unsent_bodies`: requests to /metrics that declare a chunked body and never send a chunk;
- `preface_only`: connections to the agents' TCP port that send the HTTP/2 preface and nothing
  more (the sidecar's port with a token, as any local user reaches it);
- `watch_streams`: gRPC health Watch streams on that port, opened again as they end;
- `non_reading_scrapers`: requests for /metrics whose answer is never read;
- `unknown_fields`: an agent (on the Unix socket) whose reports carry ~900 kB of fields the
  sidecar does not know;
- `amplified_answers`: an agent that answers every command with 100,000 device settings, while an
  admin client sends a settings command to it every two seconds.

A prober asks /healthz every second. The attack phase is timed once every crowd has gathered
(opened as many connections as it keeps, counting those the sidecar closed meanwhile), so that
the figures are those of an attack in progress. Per phase it prints scrape latency (p50, p99,
max), failed scrapes and probes (must be 0), the sidecar's CPU share and largest RSS (must stay
within --rss-limit-mib, the manifests' memory limit), and the attackers' own CPU share (on a
small machine they share its cores with the sidecar); over the run, the well-behaved agents'
reports lost (sent by them, never received: must be 0, read per agent from the admin API), and
the ratio attack p99 / quiet p99 (≤ 2). Each attacker's counts say what it managed.

    python -m bench.sidecar.attack_load --json                  # 60 + 60 s
    python -m bench.sidecar.attack_load --seconds 20 --json     # a shorter run

The sidecar runs as its own process (`allocwatch sidecar`) under a 1,024-descriptor limit;
agents in --workers processes (the real agent code: bench.sidecar.sidecar_load's workers);
the attackers in a process of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from bench import REPO
from bench.lib import source_tree
from bench.lib.ports import free_port
from bench.sidecar.sidecar_load import (
    Scraper,
    SidecarUsage,
    _figures,
    _percentiles,
    _raise_descriptor_limit,
    start_workers,
    wait_for_sidecar,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HOSTILE_RANK = 1000  # ranks of the hostile agents start here; the good ones are 0..N-1
GATHER_SECONDS = 30.0  # at most, for the crowds to gather before the attack is timed
GATHERED = "gathered"  # the attacker's first line once they have
CLASSES = ("unsent_bodies", "preface_only", "watch_streams", "non_reading_scrapers",
           "unknown_fields", "amplified_answers")


# ---------------------------------------------------------------------------- attackers


class Deadline:
    """When the attack ends (time.monotonic()): provisional while the crowds gather, then
    `seconds` after they have. Streams opened before then are cancelled at the end."""

    def __init__(self, at: float):
        self.at = at
        self._calls: list = []
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.at - time.monotonic()

    def timeout(self) -> float:
        return max(0.1, self.left())

    def opened(self, call) -> None:
        with self._lock:
            self._calls.append(call)

    def cancel_calls(self) -> None:
        with self._lock:
            for call in self._calls:
                call.cancel()


class Crowd:
    """`count` connections to `port` kept open: each sends `request` and is opened again
    (at most `rate` a second) once the sidecar closes it."""

    def __init__(self, name: str, port: int, count: int, request: bytes, rate: float,
                 receive_buffer: int = 0):
        self.name, self.port, self.count, self.request = name, port, count, request
        self.rate, self.receive_buffer = rate, receive_buffer
        self.opened = self.closed_by_sidecar = self.failed = 0
        self.launched = 0

    @property
    def gathered(self) -> bool:
        """Whether it has opened (or begun to open) as many connections as it keeps: its
        ramp is over (those the sidecar closes at once are never all open together)."""
        return self.launched >= self.count

    async def run(self, until: Deadline) -> None:
        loop = asyncio.get_running_loop()
        open_now: set[asyncio.Task[None]] = set()
        while until.left() > 0:
            while len(open_now) < self.count and until.left() > 0:
                task = loop.create_task(self._one(until))
                open_now.add(task)
                task.add_done_callback(open_now.discard)
                self.launched += 1
                await asyncio.sleep(1.0 / self.rate)
            await asyncio.sleep(0.05)
        for task in open_now:
            task.cancel()
        await asyncio.gather(*open_now, return_exceptions=True)

    async def _one(self, until: Deadline) -> None:
        sock = socket.socket()
        if self.receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, ("127.0.0.1", self.port))
            self.opened += 1
            await loop.sock_sendall(sock, self.request)
            if self.receive_buffer:  # read the first bytes (its build is done), then stop
                await loop.sock_recv(sock, 1024)
                while until.left() > 0:  # read nothing; note when the sidecar cuts it
                    await asyncio.sleep(1.0)
                    try:
                        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        continue
                    except OSError:
                        break  # reset: cut at its deadline or as a slow reader
                else:
                    return
            else:
                while await loop.sock_recv(sock, 65536):
                    pass
            self.closed_by_sidecar += 1
        except (ConnectionError, OSError):
            self.closed_by_sidecar += 1
        finally:
            sock.close()

    def counts(self) -> dict[str, int]:
        return {"opened": self.opened, "closed_by_sidecar": self.closed_by_sidecar}


def watch_streams(target: str, streams: int, until: Deadline, out: dict) -> None:
    """Health Watch streams on `target`, each opened again once it ends."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    out.update(opened=0, refused=0, ended=0)
    lock = threading.Lock()

    def one(n: int) -> None:
        while until.left() > 0:
            channel = grpc.insecure_channel(target,
                                            options=[("grpc.use_local_subchannel_pool", 1)])
            try:
                call = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=f"svc-{n}"), timeout=until.timeout())
                until.opened(call)
                with lock:
                    out["opened"] += 1
                for _ in call:
                    pass
            except grpc.RpcError as err:
                with lock:
                    key = "refused" if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED \
                        else "ended"
                    out[key] += 1
            finally:
                channel.close()
            time.sleep(0.2)

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(until.left() + 5)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _HostileStream:
    """One stream of a hostile agent: its hello, then its reports (with `padding`, unknown
    fields, where given) and the answers queued by `answer`."""

    def __init__(self, hello, padding: bytes, until: Deadline, out: dict):
        self.hello, self.padding, self.until, self.out = hello, padding, until, out
        self.stop = threading.Event()
        self.ready = threading.Condition()
        self.outgoing: list = []

    def answer(self, message) -> None:
        with self.ready:
            self.outgoing.append(message)
            self.ready.notify()

    def messages(self):
        from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

        yield self.hello
        sequence = 0
        while not self.stop.is_set() and self.until.left() > 0:
            with self.ready:
                if not self.outgoing:
                    self.ready.wait(0.5)
                pending, self.outgoing = self.outgoing, []
            yield from pending
            if self.padding:
                sequence += 1
                report = pb.Report(sequence=sequence, timestamp_seconds=time.time())
                report.devices.add(cuda_device=0, gpu_uuid="GPU-hostile")
                # The unknown field inside the report: field 2 of AgentMessage wraps it.
                inner = report.SerializeToString() + self.padding
                yield _varint((2 << 3) | 2) + _varint(len(inner)) + inner
                self.out["reports"] += 1
                time.sleep(0.2)


def hostile_agent(target: str, rank: int, until: Deadline, out: dict, *, unknown: int = 0,
                  amplify: bool = False) -> None:
    """An agent on `target` whose reports carry `unknown` bytes of unknown fields, or which
    answers every command with 100,000 device settings (`amplify`); it reconnects when the
    sidecar ends its stream."""
    import grpc

    from allocator_ext.agent.identity import build_identity
    from allocator_ext.protocol.handshake import local_version
    from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
    from allocator_ext.protocol.service import CONNECT_METHOD

    out.update(streams=0, reports=0, answers=0, ended=0)
    padding = _varint((1000 << 3) | 2) + _varint(unknown) + b"u" * unknown if unknown else b""
    hello = pb.AgentMessage(hello=pb.Hello(protocol_version=local_version(), identity=(
        build_identity(backend="allocwatch", overrides={"rank": rank}))))
    while until.left() > 0:
        stream = _HostileStream(hello, padding, until, out)
        channel = grpc.insecure_channel(target)
        connect = channel.stream_stream(
            CONNECT_METHOD,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=pb.SidecarMessage.FromString)
        try:
            call = connect(stream.messages(), timeout=until.timeout())
            until.opened(call)
            out["streams"] += 1
            for message in call:
                if message.HasField("command") and amplify:
                    stream.answer(pb.AgentMessage(command_result=pb.CommandResult(
                        command_id=message.command.id, status=pb.CommandResult.OK,
                        settings_in_force=[pb.DeviceSettings()] * 100_000)))
                    out["answers"] += 1
        except grpc.RpcError:
            out["ended"] += 1
        finally:
            stream.stop.set()
            channel.close()
        time.sleep(0.5)


def admin_commands(admin_socket: str, rank: int, until: Deadline, out: dict) -> None:
    """A settings command to the agent of `rank` every two seconds (what makes the amplifying
    agent answer)."""
    out.update(sent=0, answered=0, reply_bytes_max=0)
    body = json.dumps({"settings": "garbage_collection_threshold:0.8", "rank": rank}).encode()
    while until.left() > 0:
        conn = _UnixHttp(admin_socket, timeout=30)
        try:
            conn.request("POST", "/v1/settings", body=body,
                         headers={"Content-Type": "application/json"})
            answer = conn.getresponse().read()
            out["sent"] += 1
            out["answered"] += 1
            out["reply_bytes_max"] = max(out["reply_bytes_max"], len(answer))
        except OSError:
            out["sent"] += 1
        finally:
            conn.close()
        time.sleep(2.0)


class _UnixHttp(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def attacker(metrics_port: int, agents_tcp: str, agents_unix: str, admin_socket: str,
             seconds: float, classes: set[str]) -> None:
    """The `classes` at once: once every crowd has gathered it prints GATHERED, then goes on
    for `seconds`, and prints what each managed (and its own CPU time) as JSON."""
    _raise_descriptor_limit(4096)
    until = Deadline(time.monotonic() + GATHER_SECONDS + seconds)
    crowds = [
        Crowd("unsent_bodies", metrics_port, 300, b"GET /metrics HTTP/1.1\r\nHost: a\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n", rate=200),
        Crowd("preface_only", int(agents_tcp.rsplit(":", 1)[1]), 1100, PREFACE, rate=500),
        Crowd("non_reading_scrapers", metrics_port, 250, b"GET /metrics HTTP/1.1\r\n"
              b"Host: a\r\n\r\n", rate=50, receive_buffer=4096),
    ]
    crowds = [crowd for crowd in crowds if crowd.name in classes]
    results: dict[str, dict] = {name: {} for name in (*CLASSES, "admin_commands")}
    threads = [
        threading.Thread(target=watch_streams, args=(agents_tcp, 64, until,
                                                     results["watch_streams"]), daemon=True),
        threading.Thread(target=hostile_agent, args=(agents_unix, HOSTILE_RANK, until,
                                                     results["unknown_fields"]),
                         kwargs={"unknown": 900 << 10}, daemon=True),
        threading.Thread(target=hostile_agent, args=(agents_unix, HOSTILE_RANK + 1, until,
                                                     results["amplified_answers"]),
                         kwargs={"amplify": True}, daemon=True),
        threading.Thread(target=admin_commands, args=(admin_socket, HOSTILE_RANK + 1,
                                                      until, results["admin_commands"]),
                         daemon=True),
    ]
    wanted = {"watch_streams": 0, "unknown_fields": 1, "amplified_answers": 2}
    threads = [t for name, n in wanted.items() if name in classes for t in (
        [threads[n], threads[3]] if name == "amplified_answers" else [threads[n]])]
    for thread in threads:
        thread.start()
    # What each class has opened once it has gathered (threads fill in their counts).
    opening = {"watch_streams": ("opened", 64), "unknown_fields": ("streams", 1),
               "amplified_answers": ("streams", 1)}

    def gathered() -> bool:
        return all(crowd.gathered for crowd in crowds) and all(
            results[name].get(key, 0) >= count for name, (key, count) in opening.items()
            if name in classes)

    async def announce() -> None:
        while not gathered() and until.left() > seconds:
            await asyncio.sleep(0.1)
        until.at = time.monotonic() + seconds + 1.0  # past the timed phase's end
        print(GATHERED, flush=True)

    async def crowds_run() -> None:
        await asyncio.gather(announce(), *(crowd.run(until) for crowd in crowds))

    asyncio.run(crowds_run())
    until.cancel_calls()  # streams opened while the deadline was provisional
    for thread in threads:
        thread.join(10)
    for crowd in crowds:
        results[crowd.name] = crowd.counts()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    results["cpu"] = {"seconds": round(usage.ru_utime + usage.ru_stime, 2)}
    print(json.dumps({k: v for k, v in results.items() if v}), flush=True)


# ---------------------------------------------------------------------------- the run


def _prober(url: str, until: float, out: dict) -> None:
    out.update(probes=0, failed=0)
    while time.monotonic() < until:
        try:
            conn = http.client.HTTPConnection(url.split("//", 1)[1], timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status != 200:
                out["failed"] += 1
            conn.close()
        except OSError:
            out["failed"] += 1
        out["probes"] += 1
        time.sleep(1.0)


def run_phase(name: str, seconds: float, port: int, scrapers: int, interval: float,
              usage: SidecarUsage, url: str, attack: list[str] | None) -> dict:
    attackers = None
    rss_max = usage.rss_mib()
    if attack is not None:
        attackers_started = time.monotonic()
        attackers = subprocess.Popen([sys.executable, "-m", __spec__.name, "--attacker",
                                      *attack[:4], str(seconds), attack[4]], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)
        rss_max = max(rss_max, _until_gathered(attackers, usage))
    start = time.monotonic() + 0.2
    crowd = [Scraper(port, start, interval, start + seconds) for _ in range(scrapers)]
    probe: dict = {}
    prober = threading.Thread(target=_prober, args=(url, start + seconds, probe), daemon=True)
    cpu_before = usage.cpu_seconds()
    for scraper in crowd:
        scraper.start()
    prober.start()
    while any(s.is_alive() for s in crowd):
        rss_max = max(rss_max, usage.rss_mib())
        time.sleep(0.25)
    prober.join(10)
    cpu = usage.cpu_seconds() - cpu_before
    latencies = [latency for s in crowd for latency in s.latencies]
    failures = [failure for s in crowd for failure in s.failures]
    result = {
        "phase": name, "seconds": seconds, "scrapers": scrapers,
        "scrapes": len(latencies), "scrape_ms": _percentiles(latencies),
        "scrape_failures": len(failures), "scrape_failure_kinds": sorted(set(failures)),
        "health_probes": probe.get("probes", 0), "health_failures": probe.get("failed", 0),
        "sidecar_cpu_share": round(cpu / seconds, 3), "sidecar_rss_max_mib": round(rss_max, 1),
    }
    if attackers is not None:
        out, _ = attackers.communicate(timeout=seconds + 120)
        result["attackers"] = json.loads(out.strip().splitlines()[-1])
        result["attackers_cpu_share"] = round(result["attackers"]["cpu"]["seconds"] / (
            time.monotonic() - attackers_started), 3)
        result["sidecar_rss_after_mib"] = round(usage.rss_mib(), 1)
    return result


def _until_gathered(attackers: subprocess.Popen, usage: SidecarUsage) -> float:
    """Waits for the attackers' crowds to gather (their first line); the sidecar's largest
    RSS meanwhile."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(attackers.stdout.readline()),  # type: ignore
                     daemon=True).start()
    rss_max = 0.0
    deadline = time.monotonic() + GATHER_SECONDS + 30
    while time.monotonic() < deadline:
        rss_max = max(rss_max, usage.rss_mib())
        try:
            line = lines.get(timeout=0.25)
        except queue.Empty:
            continue
        if line.strip() != GATHERED:
            raise SystemExit(f"the attackers did not gather: {line.strip() or 'exited'}")
        return rss_max
    raise SystemExit(f"the attackers did not gather within {GATHER_SECONDS + 30:g} s")


def _good_agents_received(admin_socket: str, agents: int) -> int:
    conn = _UnixHttp(admin_socket, timeout=30)
    conn.request("GET", "/v1/agents")
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return sum(a["reports_received"] for a in answer["agents"] if 0 <= a["rank"] < agents)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--rate", type=float, default=10.0, help="reports per second per agent")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of each phase")
    parser.add_argument("--scrapers", type=int, default=4)
    parser.add_argument("--scrape-interval", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=4, help="agent processes")
    parser.add_argument("--rss-limit-mib", type=float, default=256.0)
    parser.add_argument("--classes", default=",".join(CLASSES),
                        help="the attack classes, comma-separated (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--attacker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        metrics_port, tcp, unix, admin, seconds, classes = args.attacker
        attacker(int(metrics_port), tcp, unix, admin, float(seconds), set(classes.split(",")))
        return 0
    unknown = set(args.classes.split(",")) - set(CLASSES)
    if unknown:
        parser.error(f"--classes: unknown {', '.join(sorted(unknown))} (known: "
                     f"{', '.join(CLASSES)})")

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    _raise_descriptor_limit(2048)
    tmp = Path(tempfile.mkdtemp(prefix="aw-attack-", dir="/tmp"))
    port, tcp_port = free_port(), free_port()
    run = tmp / "run"
    (tmp / "sidecar.yaml").write_text(textwrap.dedent(f"""\
        agents: {{unix_socket: {run / 'agent.sock'}, tcp_port: {tcp_port},
                  token_file: {run / 'token'}}}
        metrics: {{address: 127.0.0.1, port: {port}}}
        nvml: {{enabled: false}}
        logging: {{level: warning}}
        """))
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "sidecar", "--config", str(tmp / "sidecar.yaml")],
        cwd=REPO, stderr=(tmp / "sidecar.log").open("w"),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard)))
    usage = SidecarUsage(sidecar.pid)
    url = f"http://127.0.0.1:{port}"
    workers: list[subprocess.Popen] = []
    phases = []
    try:
        wait_for_sidecar(port)
        rss_start = usage.rss_mib()
        workers.extend(start_workers(run / "agent.sock", args.agents, args.workers, args.rate))
        deadline = time.monotonic() + 60
        while _figures(port, {"allocwatch_agents_connected"}).get(
                "allocwatch_agents_connected", 0) < args.agents:
            if time.monotonic() > deadline:
                raise SystemExit("the agents did not all connect within 60 s")
            time.sleep(0.2)
        time.sleep(1.0)
        attack = [str(port), f"127.0.0.1:{tcp_port}", f"unix://{run / 'agent.sock'}",
                  str(run / "admin.sock"), args.classes]
        for name, hostile in (("quiet", None), ("attack", attack)):
            phases.append(run_phase(name, args.seconds, port, args.scrapers,
                                    args.scrape_interval, usage, url, hostile))
        sent = dropped = 0
        for w in workers:
            out, _ = w.communicate(input="", timeout=120)
            figures = json.loads(out.strip().splitlines()[-1])
            sent += figures["sent"]
            dropped += figures["dropped"]
        time.sleep(0.5)
        received = _good_agents_received(str(run / "admin.sock"), args.agents)
        refused = _figures(port, {"allocwatch_refused_total"})
        closed = _figures(port, {"allocwatch_http_connections_closed_total"})
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(10)
        except subprocess.TimeoutExpired:
            sidecar.kill()
    by_name = {phase["phase"]: phase for phase in phases}
    quiet_p99 = by_name["quiet"]["scrape_ms"]["p99"]
    attack_p99 = by_name["attack"]["scrape_ms"]["p99"]
    rss_max = max(p["sidecar_rss_max_mib"] for p in phases)
    result = {
        "agents": args.agents, "rate_per_agent": args.rate, "cpu_count": os.cpu_count(),
        "source": source_tree.label(), "phases": phases,
        "attack_p99_over_quiet_p99": round(attack_p99 / quiet_p99, 2)
        if quiet_p99 and attack_p99 is not None else None,
        "scrape_failures": sum(p["scrape_failures"] for p in phases),
        "health_failures": sum(p["health_failures"] for p in phases),
        "sidecar_rss_start_mib": round(rss_start, 1), "sidecar_rss_max_mib": rss_max,
        "reports_sent": sent, "reports_received": received, "reports_lost": sent - received,
        "reports_dropped_by_agents": dropped,
        "refused": {k.split(",", 1)[1]: v for k, v in refused.items() if "," in k},
        "connections_closed": {k.split(",", 1)[1]: v for k, v in closed.items() if "," in k},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), "-m", __spec__.name,
                             *sys.argv[1:]]),
    }
    ok = (result["scrape_failures"] == 0 and result["health_failures"] == 0
          and result["reports_lost"] == 0 and rss_max <= args.rss_limit_mib
          and (result["attack_p99_over_quiet_p99"] or 99) <= 2.0)
    result["meets_bars"] = ok
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key != "phases":
                print(f"{key:28} {value}")
        for phase in phases:
            print(json.dumps(phase))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
