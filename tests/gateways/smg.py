"""SMG (the Shepherd Model Gateway, PyPI `smg`) in front of real Plimsoll workers, for
the gateway tests: `start_gateway` runs `smg launch` as a subprocess on a free loopback
port and waits until every worker it was given is registered and ready; `Gateway` has
small OpenAI-over-HTTP helpers (stdlib only: the requests are few and short).
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.harness.server import ServerProcess, free_port, start_server, wait_all_serving

# The binary pip installs beside this interpreter (the `smg` console script).
SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
# Probe fast so pressure is seen within a second or two; retries off so that what a
# worker answers is what the test sees (SMG's retry would hide a shed).
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--health-check-timeout-secs", "2")


def smg_version() -> str:
    """The installed distribution's version (the wheel's own `smg/version.py` still
    says 1.1.0 in 1.13.0; the binary's start-up banner says 1.13.0, as pip does)."""
    return importlib.metadata.version("smg")


@dataclass
class HttpAnswer:
    status: int
    body: str
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Gateway:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 10) -> HttpAnswer:
        return self._call(urllib.request.Request(self.base + path), timeout)

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None,
             timeout: float = 120) -> HttpAnswer:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
        return self._call(req, timeout)

    def stream(self, path: str, body: dict, headers: dict[str, str] | None = None,
               timeout: float = 120) -> list[dict]:
        """The `data:` events of an SSE answer, parsed, up to `[DONE]`."""
        answer = self.post(path, {**body, "stream": True}, headers, timeout)
        assert answer.status == 200, answer.body
        events = []
        for line in answer.body.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
        return events

    def workers(self) -> list[dict]:
        return self.get("/workers").json()["workers"]

    @staticmethod
    def _call(req: urllib.request.Request, timeout: float) -> HttpAnswer:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return HttpAnswer(r.status, r.read().decode(), dict(r.headers))
        except urllib.error.HTTPError as e:
            return HttpAnswer(e.code, e.read().decode(), dict(e.headers))

    def stop(self) -> None:
        """SIGKILL: on SIGTERM or SIGINT the gateway keeps its listener open for a fixed
        5 s load-balancer settle that `smg launch` cannot change; no test asserts on the
        gateway's own exit, and it keeps no state or children."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_gateway(log_dir: Path, worker_addresses: list[str], model_path: Path,
                  *args: str, timeout: float = 60) -> Gateway:
    """`smg launch` over gRPC workers (`grpc://host:port`), `--model-path` for the
    tokenizer; returns once every worker is registered and ready."""
    assert SMG, "the smg binary is not installed (pip install smg)"
    port = free_port()
    log_path = log_dir / f"smg-{port}.log"
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *(f"grpc://{a}" for a in worker_addresses),
           "--model-path", str(model_path), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    gw = Gateway(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited early ({proc.returncode}):\n{gw.log()[-3000:]}")
        try:
            ready = [w for w in gw.workers() if w.get("status") == "ready"]
            if len(ready) == len(worker_addresses):
                return gw
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    gw.stop()
    raise TimeoutError(f"smg did not register {worker_addresses} in {timeout}s:\n"
                       f"{gw.log()[-3000:]}")


def scrape(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples on a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def smg_fleet(log_dir: Path, model_path: Path, policy: str, workers: int = 2
              ) -> Iterator[tuple[Gateway, list[ServerProcess]]]:
    """`workers` Plimsoll workers behind one `smg launch` with `policy`, all stopped after."""
    started = [start_server(log_dir, "--memory-guard-gb", "8", wait=False)
               for _ in range(workers)]
    wait_all_serving(started)
    gateway = None
    try:
        gateway = start_gateway(log_dir, [w.address for w in started], model_path,
                                "--policy", policy, *FAST_HEALTH)
        yield gateway, started
    finally:
        if gateway is not None:
            gateway.stop()
        for w in started:
            w.stop()
