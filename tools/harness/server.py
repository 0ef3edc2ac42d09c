"""A Plimsoll server as a subprocess (`python -m service.cli serve`), on a free loopback port.

`start_server(log_dir, *args)` starts one (optionally behind a command `prefix`, such as
`ChildCgroup.prefix()`, and with extra environment), by default waits until its health
service says SERVING, and returns a `ServerProcess`: its address, gRPC channel and stubs,
its log, `freeze()` / `thaw()` (SIGSTOP / SIGCONT, so that an idle server does not compete
with an in-process baseline) and `stop(sig)`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plimsoll.v1 import control_pb2_grpc, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent.parent

# Until a fresh server listens, each connection attempt fails and gRPC backs off (1 s at
# first, then longer) before the next: polling health on a default channel noticed a
# ready server 0.5-0.9 s late. Starting servers is most of what the tests wait for.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50),
                  ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 250)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    frozen: bool = False
    # TLS credentials for the harness's own channels (a server started with --tls-cert).
    credentials: grpc.ChannelCredentials | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, options=options)
        return grpc.insecure_channel(self.address, options=options)

    @contextmanager
    def stubs(self) -> Iterator[tuple[control_pb2_grpc.ControlServiceStub,
                                      inference_pb2_grpc.InferenceServiceStub]]:
        """(control, inference) stubs on one channel, closed afterwards."""
        with self.channel() as ch:
            yield (control_pb2_grpc.ControlServiceStub(ch),
                   inference_pb2_grpc.InferenceServiceStub(ch))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 180) -> None:
        """Until the health service says SERVING; raises if the server exits first."""
        deadline = time.monotonic() + timeout
        with self.channel(FAST_RECONNECT) as ch:  # health needs no token, only the TLS
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited early:\n{self.log()[-3000:]}")
                with suppress(grpc.RpcError):
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.05)
        raise TimeoutError(f"server not SERVING after {timeout}s:\n{self.log()[-3000:]}")

    def freeze(self) -> None:
        """SIGSTOP the server (until `thaw`)."""
        if not self.frozen:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.frozen = False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send `sig` (thawing first), wait up to `timeout`, then SIGKILL; the exit code."""
        self.thaw()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(log_dir: Path, *args: str, env: dict | None = None, wait: bool = True,
                 prefix: list[str] | None = None, timeout: float = 180,
                 credentials: grpc.ChannelCredentials | None = None,
                 cwd: Path = ROOT) -> ServerProcess:
    """`plimsoll serve --port <free> *args`, logging to `log_dir`; waits for SERVING if `wait`.
    `credentials`: TLS for the harness's channels, when `args` turn TLS on. `cwd`: the
    checkout whose code serves (another one's, for a benchmark against an older commit)."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [*(prefix or []), sys.executable, "-m", "service.cli", "serve",
           "--port", str(port), *args]
    # An exported PLIMSOLL_TOKEN would lock the server; only `env` may set it.
    full_env = {**{k: v for k, v in os.environ.items() if k != "PLIMSOLL_TOKEN"},
                **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env)
    server = ServerProcess(proc, port, log_path, credentials=credentials)
    if wait:
        try:
            server.wait_serving(timeout)
        except BaseException:
            server.stop(signal.SIGKILL)
            raise
    return server


def wait_all_serving(servers: list[ServerProcess], timeout: float = 180) -> None:
    """Wait for servers started with `wait=False` (they import and load side by side, on
    every core); if one fails, all are killed and the error raised."""
    try:
        for srv in servers:
            srv.wait_serving(timeout)
    except BaseException:
        for srv in servers:
            srv.stop(signal.SIGKILL)
        raise


@contextmanager
def serving(log_dir: Path, *args: str, env: dict | None = None,
            prefix: list[str] | None = None, timeout: float = 180,
            cwd: Path = ROOT) -> Iterator[ServerProcess]:
    """A SERVING server for the duration of the block, stopped after it; when the block
    raises, the tail of the server's log goes to stderr first."""
    srv = start_server(log_dir, *args, env=env, prefix=prefix, timeout=timeout, cwd=cwd)
    try:
        yield srv
    except BaseException:
        with suppress(Exception):
            print(f"server log tail:\n{srv.log()[-3000:]}", file=sys.stderr, flush=True)
        raise
    finally:
        srv.stop()
