"""HAProxy (Debian's `haproxy`, 2.6) in front of Plimsoll workers, for tests and tools.

`start_haproxy(work_dir, backends)` writes a config (h2c gRPC: `mode http`, a frontend
`bind ... proto h2` per backend, `server ... proto h2 check agent-check`), runs
`haproxy -db -f CONFIG` in the foreground and returns a `Haproxy`: each frontend's
port, the admin socket (`servers()` reads each server's state and weight from
`show stat`), its log and `stop()`. Every response carries the name of the server
that answered in the `x-plimsoll-worker` header, which a gRPC client reads as
initial metadata.

`HAPROXY` is the binary's path, None where it is not installed.
"""

from __future__ import annotations

import csv
import io
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from tools.harness.server import free_port

HAPROXY = shutil.which("haproxy")
WORKER_HEADER = "x-plimsoll-worker"


def haproxy_version() -> str:
    """E.g. "2.6.12-1+deb12u4" (the first line of `haproxy -v`)."""
    if HAPROXY is None:
        return ""
    out = subprocess.run([HAPROXY, "-v"], capture_output=True, text=True, timeout=10).stdout
    words = out.split()
    return words[2] if len(words) > 2 and words[0] == "HAProxy" else out.strip()


@dataclass(frozen=True)
class Worker:
    name: str
    port: int  # gRPC (h2c)
    agent_port: int


@dataclass(frozen=True)
class Backend:
    """One frontend/backend pair. `balance`: "roundrobin", or "hdr(x-session-id)" to
    hash a gRPC metadata header (consistent hashing, so a drained server moves only
    its own keys, and they come back with it)."""

    name: str
    workers: Sequence[Worker]
    balance: str = "roundrobin"
    agent_inter: str = "500ms"
    extra: Sequence[str] = ()  # more backend lines


def render_config(backends: Sequence[Backend], ports: dict[str, int], admin_socket: Path,
                  check_inter: str = "1s") -> str:
    lines = [
        "global",
        f"    stats socket {admin_socket} mode 600 level admin",
        "    log stdout format raw local0 info",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    timeout connect 2s",
        "    timeout client 120s",
        "    timeout server 120s",
        "",
    ]
    for b in backends:
        lines += [
            f"frontend fe_{b.name}",
            f"    bind 127.0.0.1:{ports[b.name]} proto h2",
            f"    default_backend be_{b.name}",
            "",
            f"backend be_{b.name}",
            f"    balance {b.balance}",
        ]
        if b.balance.startswith("hdr("):
            lines.append("    hash-type consistent")
        lines.append(f"    http-response set-header {WORKER_HEADER} %[srv_name]")
        lines += [f"    {x}" for x in b.extra]
        for w in b.workers:
            # weight 100: the agent's "50%" is of the configured weight, and the
            # default weight 1 cannot be halved.
            lines.append(
                f"    server {w.name} 127.0.0.1:{w.port} proto h2 weight 100 "
                f"check inter {check_inter} agent-check agent-port {w.agent_port} "
                f"agent-inter {b.agent_inter}")
        lines.append("")
    return "\n".join(lines)


@dataclass
class ServerState:
    backend: str
    name: str
    status: str  # UP, DOWN, DRAIN, MAINT, "UP 1/2", ...
    weight: int
    total: int  # stot: sessions (requests, for h2) sent to it so far
    agent_status: str  # e.g. L7OK
    agent_description: str  # the agent's last line, as HAProxy read it


@dataclass
class Haproxy:
    proc: subprocess.Popen
    config_path: Path
    admin_socket: Path
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)

    def address(self, backend: str) -> str:
        return f"127.0.0.1:{self.ports[backend]}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def command(self, line: str, timeout: float = 5.0) -> str:
        """One command on the admin socket (`show stat`, `show servers state`, ...)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(self.admin_socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def servers(self) -> dict[tuple[str, str], ServerState]:
        """(backend, server) -> its state, from `show stat`."""
        text = self.command("show stat").lstrip("# ")
        out = {}
        for row in csv.DictReader(io.StringIO(text)):
            if row.get("svname") in ("FRONTEND", "BACKEND", None):
                continue
            out[(row["pxname"], row["svname"])] = ServerState(
                row["pxname"], row["svname"], row.get("status", ""),
                int(row.get("weight") or 0), int(row.get("stot") or 0),
                row.get("agent_status", ""), row.get("agent_desc", ""))
        return out

    def server(self, backend: str, name: str) -> ServerState:
        return self.servers()[(f"be_{backend}", name)]

    def wait_server(self, backend: str, name: str, predicate, timeout: float = 30.0,
                    ) -> ServerState:
        """Until `predicate(state)`; raises TimeoutError with the last state seen."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            with suppress(OSError, KeyError):
                state = self.server(backend, name)
                if predicate(state):
                    return state
            time.sleep(0.05)
        raise TimeoutError(f"{backend}/{name}: still {state} after {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_haproxy(work_dir: Path, backends: Sequence[Backend],
                  timeout: float = 15.0) -> Haproxy:
    if HAPROXY is None:
        raise FileNotFoundError("haproxy is not installed")
    ports = {b.name: free_port() for b in backends}
    admin = work_dir / "haproxy-admin.sock"
    config = work_dir / "haproxy.cfg"
    config.write_text(render_config(backends, ports, admin) + "\n")
    check = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True,
                           timeout=30)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy -c refused {config}:\n{check.stdout}{check.stderr}")
    log_path = work_dir / "haproxy.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=log,
                                stderr=subprocess.STDOUT)
    hap = Haproxy(proc, config, admin, log_path, ports)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited early:\n{hap.log()[-3000:]}")
        with suppress(OSError):
            hap.servers()
            with socket.create_connection(("127.0.0.1", next(iter(ports.values()))), 1):
                return hap
        time.sleep(0.05)
    hap.stop()
    raise TimeoutError(f"haproxy not listening after {timeout}s:\n{hap.log()[-3000:]}")
