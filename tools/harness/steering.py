"""Pressure steering through a gateway: squeeze one worker, drive load, count who served.

- `Squeeze`: a worker in a child memory cgroup (tools.harness.cgroup) whose limit is
  lowered until the worker's own usage sits at a chosen share of its ceiling (between
  its hard mark and the ceiling: level HARD, not emergency), and raised again.
- `LoadRun`: client threads sending short Generates through a gateway address until
  stopped; each attempt is recorded with the worker that answered (HAProxy's
  `x-plimsoll-worker` response header) and how it ended; a typed retryable end
  (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED) is retried, as a client following the
  RetryInfo would, and a request is *lost* only when it never completes.
- `agent_line(port)`: what the worker's agent check answers now.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tools.harness.cgroup import ChildCgroup, limit_for_ceiling
from tools.harness.haproxy import WORKER_HEADER
from tools.harness.server import ServerProcess

GIB = 1 << 30
ROOMY_LIMIT = 4 * GIB  # a ceiling of ~3.6 GiB: a tiny-model worker is at level ok
SOFT_FRACTION, HARD_FRACTION = 0.3, 0.5  # wide marks: HARD is a band of half the ceiling
PRESSED = 0.7  # usage / ceiling once squeezed: above hard, well under the ceiling
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED)
INFERENCE = "plimsoll.v1.InferenceService"


def worker_args(hold_s: float, agent_port: int) -> tuple[str, ...]:
    """`plimsoll serve` flags for a steering worker: custom tier (the machine's other
    tenants cannot move the ceiling), fast polls, a short admission wait (a request
    that lands on a squeezed worker before the gateway reacts ends typed, soon)."""
    return ("--memory-guard-gb", "8", "--soft-fraction", str(SOFT_FRACTION),
            "--hard-fraction", str(HARD_FRACTION), "--poll-active", "0.25",
            "--poll-idle", "0.25", "--poll-empty", "0.25", "--admission-timeout", "2",
            "--unready-hold-seconds", str(hold_s), "--agent-port", str(agent_port))


def memory_status(worker: ServerProcess) -> control_pb2.GetMemoryStatusResponse:
    with worker.channel() as ch:
        return control_pb2_grpc.ControlServiceStub(ch).GetMemoryStatus(
            control_pb2.GetMemoryStatusRequest(), timeout=10)


def health(worker: ServerProcess, service: str = INFERENCE) -> int:
    with worker.channel() as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


def pin_default(worker: ServerProcess, owner: str = "steering") -> None:
    """At hard an idle unpinned model is unloaded: pinned, the worker stays ready."""
    with worker.channel() as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        models = control.ListModels(control_pb2.ListModelsRequest(), timeout=30).models
        default = next(m.model_id for m in models if m.is_default)
        control.Pin(control_pb2.PinRequest(model_id=default, owner=owner), timeout=30)


def agent_line(port: int, timeout: float = 5.0) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.settimeout(timeout)
        data = b""
        while b"\n" not in data:
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode().strip()


def wait_for(what: str, check: Callable[[], object], timeout: float = 30.0,
             period: float = 0.05):
    """`check()`'s first truthy value; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(period)


@dataclass
class Squeeze:
    worker: ServerProcess
    cgroup: ChildCgroup
    roomy_limit: int = ROOMY_LIMIT

    def press(self, ratio: float = PRESSED) -> int:
        """Lowers the limit so that usage / ceiling is `ratio`; the new limit."""
        status = memory_status(self.worker)
        usage, total = status.readings.process_bytes, status.readings.system_total_bytes
        limit = limit_for_ceiling(int(usage / ratio), total)
        self.cgroup.set_limit(limit)
        return limit

    def release(self) -> None:
        self.cgroup.set_limit(self.roomy_limit)

    def level(self) -> int:
        return memory_status(self.worker).level


@dataclass
class Attempt:
    request: int  # which request this is an attempt of
    started: float
    ended: float
    worker: str  # "" when no server answered (the gateway's own 503)
    code: grpc.StatusCode
    details: str = ""
    tokens: int = 0


@dataclass
class LoadRun:
    """`clients` threads sending Generates to `address` until `stop()`."""

    address: str
    clients: int = 4
    max_tokens: int = 8
    max_attempts: int = 20
    retry_delay_s: float = 0.1
    session_of: Callable[[int], str] | None = None  # request number -> session_id
    attempts: list[Attempt] = field(default_factory=list)
    completed: dict[int, Attempt] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 0
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> LoadRun:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stops taking new requests; those under way finish (with their retries)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def _take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _client(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            while not self._stop.is_set():
                n = self._take()
                self._request(stub, n)

    def _request(self, stub, n: int) -> None:
        req = inference_pb2.GenerateRequest(text=f"request {n} through the gateway",
                                            max_tokens=self.max_tokens, ignore_eos=True)
        if self.session_of is not None:
            req.session_id = self.session_of(n)
        for _ in range(self.max_attempts):
            a = self.attempt(stub, req, n)
            with self._lock:
                self.attempts.append(a)
            if a.code == grpc.StatusCode.OK:
                with self._lock:
                    self.completed[n] = a
                return
            if a.code not in RETRYABLE:
                break
            time.sleep(self.retry_delay_s)
        with self._lock:
            self.lost.append(n)

    @staticmethod
    def attempt(stub, req: inference_pb2.GenerateRequest, n: int) -> Attempt:
        t0 = time.monotonic()
        call = stub.Generate(req, timeout=60)
        worker, tokens = "", 0
        try:
            worker = dict(call.initial_metadata()).get(WORKER_HEADER, "")
            for msg in call:
                if msg.WhichOneof("event") == "chunk":
                    tokens += len(msg.chunk.token_ids)
            return Attempt(n, t0, time.monotonic(), worker, grpc.StatusCode.OK, tokens=tokens)
        except grpc.RpcError as err:
            # A refusal is a trailers-only response: HAProxy's header is in the trailers.
            if not worker:
                worker = dict(err.trailing_metadata() or ()).get(WORKER_HEADER, "")
            return Attempt(n, t0, time.monotonic(), worker, err.code(), err.details() or "",
                           tokens)

    # -- figures -----------------------------------------------------------------------
    def started_between(self, t0: float, t1: float) -> list[Attempt]:
        return [a for a in list(self.attempts) if t0 <= a.started < t1]

    def completed_between(self, t0: float, t1: float) -> list[Attempt]:
        return [a for a in list(self.completed.values()) if t0 <= a.ended < t1]
