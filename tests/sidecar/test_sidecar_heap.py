"""The sidecar daemon moves what start-up made (modules, listeners, gRPC's and aiohttp's
machinery: tens of thousands of objects) out of the garbage collector's sight once it serves, so
that a full collection, which a crowd of clients brings on, walks only what came since."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.lib.ports import free_port

pytestmark = pytest.mark.timeout(90)

# The daemon as `allocwatch sidecar` runs it, with a thread that reports what the collector
# was told to leave alone once the sidecar serves, then stops it as Kubernetes would.
CHILD = textwrap.dedent("""\
    import gc, os, signal, sys, threading, time, urllib.request

    def watch(url):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(url, timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.0)  # past the start's last step
        print("frozen", gc.get_freeze_count(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, args=(sys.argv[1],), daemon=True).start()
    from exporter.cli import main
    sys.exit(main(["sidecar", "--config", sys.argv[2]]))
""")


def test_the_daemon_leaves_what_start_up_made_out_of_collections(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"agents: {{unix_socket: {tmp_path / 'run' / 'agent.sock'}}}\n"
                      f"metrics: {{address: 127.0.0.1, port: {port}}}\n"
                      "nvml: {enabled: false}\nlogging: {level: warning}\n")
    done = subprocess.run([sys.executable, "-c", CHILD, f"http://127.0.0.1:{port}/readyz",
                           str(config)], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen = int(done.stdout.split("frozen", 1)[1].split()[0])
    assert frozen > 10_000, done.stdout
