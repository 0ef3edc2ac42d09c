"""Shared pieces of the real-memory-limit tests: watchers, generators, status checks.

Everything here talks to a real server over loopback gRPC from background threads and
records what it saw, so a test can drive a scenario first and assert on the record
afterwards (and print it, for `pytest -s`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc, types_pb2
from service.convert import label

MIB = 1 << 20
LEVEL_NAMES = {
    types_pb2.PRESSURE_LEVEL_UNSPECIFIED: "unspecified",
    types_pb2.PRESSURE_LEVEL_OK: "ok",
    types_pb2.PRESSURE_LEVEL_SOFT: "soft",
    types_pb2.PRESSURE_LEVEL_HARD: "hard",
    types_pb2.PRESSURE_LEVEL_EMERGENCY: "emergency",
}
OK, SOFT, HARD, EMERGENCY = (
    types_pb2.PRESSURE_LEVEL_OK,
    types_pb2.PRESSURE_LEVEL_SOFT,
    types_pb2.PRESSURE_LEVEL_HARD,
    types_pb2.PRESSURE_LEVEL_EMERGENCY,
)


def mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB"


def level_name(level: int) -> str:
    return LEVEL_NAMES.get(level, str(level))


def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def warm_page_cache(folder: Path) -> int:
    """Read every file of a model folder from *this* process.

    The page cache is charged to the cgroup that first faults a page in. Reading the
    files here charges them to the test's own cgroup, so the server's child cgroup
    never carries model-file cache: its usage is the server's own memory, and repeated
    loads of the same files (which would turn the cache "active") cannot skew it.
    """
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                while chunk := fh.read(8 * MIB):
                    total += len(chunk)
    return total


def model_file_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------
# rich statuses


@dataclass(frozen=True)
class Ended:
    """How one RPC ended."""

    code: grpc.StatusCode
    details: str = ""
    reason: str = ""  # google.rpc.ErrorInfo.reason
    metadata: dict[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None  # google.rpc.RetryInfo
    tokens: int = 0  # tokens received before the end
    finish_reason: int = 0  # GenerateEnd.finish_reason when OK

    @property
    def has_error_info(self) -> bool:
        return bool(self.reason)

    def __str__(self) -> str:
        if self.code == grpc.StatusCode.OK:
            return f"OK ({self.tokens} tokens)"
        extra = f" reason={self.reason} {self.metadata}" if self.reason else ""
        retry = f" retry_after={self.retry_after_s}s" if self.retry_after_s is not None else ""
        return f"{self.code.name}{extra}{retry} after {self.tokens} tokens: {self.details}"


def ended_from_error(err: grpc.RpcError, tokens: int = 0) -> Ended:
    reason, metadata, retry = "", {}, None
    with contextlib.suppress(Exception):
        status = rpc_status.from_call(err)
        if status is not None:
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason, metadata = info.reason, dict(info.metadata)
                elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    retry = info.retry_delay.ToTimedelta().total_seconds()
    return Ended(err.code(), err.details() or "", reason, metadata, retry, tokens)


TYPED_SHED_CODES = (grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def is_typed_end(ended: Ended) -> bool:
    """OK, or ABORTED / RESOURCE_EXHAUSTED carrying a google.rpc.ErrorInfo reason."""
    if ended.code == grpc.StatusCode.OK:
        return True
    return ended.code in TYPED_SHED_CODES and ended.has_error_info


# ---------------------------------------------------------------------------
# long generations in background threads


class Generations:
    """N concurrent Generate streams, each on its own thread and channel."""

    def __init__(
        self,
        address: str,
        count: int,
        *,
        model: str = "",
        max_tokens: int = 1500,
        prompt: str = "the ship sails on the sea ",
        timeout_s: float = 240,
    ) -> None:
        self.address = address
        self.count = count
        self.model = model
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.timeout_s = timeout_s
        self.results: list[Ended | None] = [None] * count
        self.started = [threading.Event() for _ in range(count)]
        self.tokens = [0] * count
        self._calls: list[grpc.Call | None] = [None] * count
        self._threads: list[threading.Thread] = []

    def start(self) -> Generations:
        for i in range(self.count):
            t = threading.Thread(target=self._run, args=(i,), name=f"gen-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def wait_started(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self.started)

    def _run(self, i: int) -> None:
        req = inference_pb2.GenerateRequest(
            model_id=self.model, text=self.prompt * 4, max_tokens=self.max_tokens, ignore_eos=True
        )
        finish = 0
        try:
            with grpc.insecure_channel(self.address) as ch:
                stub = inference_pb2_grpc.InferenceServiceStub(ch)
                call = self._calls[i] = stub.Generate(req, timeout=self.timeout_s)
                for msg in call:
                    kind = msg.WhichOneof("event")
                    if kind == "start":
                        self.started[i].set()
                    elif kind == "chunk":
                        self.started[i].set()
                        self.tokens[i] += len(msg.chunk.token_ids)
                    elif kind == "end":
                        finish = msg.end.finish_reason
            self.results[i] = Ended(grpc.StatusCode.OK, tokens=self.tokens[i], finish_reason=finish)
        except grpc.RpcError as err:
            self.results[i] = ended_from_error(err, self.tokens[i])
        finally:
            self.started[i].set()

    def running(self) -> bool:
        """Every stream still open (none has ended, in any way)."""
        return all(r is None for r in self.results)

    def cancel(self) -> None:
        """Cancel every stream still open: for a test that needed them only running."""
        for call in self._calls:
            if call is not None:
                call.cancel()

    def join(self, timeout: float = 240) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


@dataclass
class Turn:
    """One Generate stream as the client saw it."""

    start: inference_pb2.GenerateStart | None = None
    token_ids: list[int] = field(default_factory=list)
    ended: Ended | None = None
    started_at: float = 0.0  # monotonic: when the start message arrived
    ended_at: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.start is not None

    @property
    def cached_tokens(self) -> int:
        return self.start.cached_tokens if self.start is not None else 0


def run_generate(
    address: str,
    request: inference_pb2.GenerateRequest,
    *,
    timeout_s: float = 120,
    on_start: Callable[[inference_pb2.GenerateStart], None] | None = None,
    turn: Turn | None = None,
) -> Turn:
    """One Generate stream to its end; `on_start` runs as soon as the start message
    arrives (before any prefill output), e.g. to look at what admission shed."""
    turn = turn if turn is not None else Turn()
    finish = 0
    try:
        with grpc.insecure_channel(address) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            for msg in stub.Generate(request, timeout=timeout_s):
                kind = msg.WhichOneof("event")
                if kind == "start":
                    turn.start = msg.start
                    turn.started_at = time.monotonic()
                    if on_start is not None:
                        on_start(msg.start)
                elif kind == "chunk":
                    turn.token_ids.extend(msg.chunk.token_ids)
                elif kind == "end":
                    finish = msg.end.finish_reason
        turn.ended = Ended(grpc.StatusCode.OK, tokens=len(turn.token_ids), finish_reason=finish)
    except grpc.RpcError as err:
        turn.ended = ended_from_error(err, len(turn.token_ids))
    turn.ended_at = time.monotonic()
    return turn


class BackgroundTurn:
    """`run_generate` on a thread of its own; `wait_tokens` blocks until it streams."""

    def __init__(
        self, address: str, request: inference_pb2.GenerateRequest, timeout_s: float = 240
    ) -> None:
        self.turn = Turn()
        self._thread = threading.Thread(
            target=run_generate,
            args=(address, request),
            kwargs={"timeout_s": timeout_s, "turn": self.turn},
            name="bg-generate",
            daemon=True,
        )

    def start(self) -> BackgroundTurn:
        self._thread.start()
        return self

    def wait_tokens(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.turn.token_ids) >= n or self.turn.ended is not None:
                break
            time.sleep(0.02)
        return len(self.turn.token_ids) >= n

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


# ---------------------------------------------------------------------------
# WatchPressure and GetMemoryStatus recorders


class PressureWatcher:
    """Subscribes to WatchPressure and keeps every message (with its arrival time)."""

    def __init__(
        self, address: str, *, include_samples: bool = False, include_actions: bool = True
    ) -> None:
        self.address = address
        self.request = control_pb2.WatchPressureRequest(
            include_samples=include_samples, include_actions=include_actions
        )
        self.messages: list[control_pb2.WatchPressureResponse] = []
        self.times: list[float] = []
        self.ended: Ended | None = None
        self.subscribed = threading.Event()
        self._channel: grpc.Channel | None = None
        self._call = None
        self._thread = threading.Thread(target=self._run, name="watch-pressure", daemon=True)
        self._lock = threading.Lock()

    def start(self, timeout: float = 30) -> PressureWatcher:
        self._thread.start()
        if not self.subscribed.wait(timeout):
            raise TimeoutError(
                f"WatchPressure sent no snapshot in {timeout}s (ended: {self.ended})"
            )
        return self

    def _run(self) -> None:
        self._channel = grpc.insecure_channel(self.address)
        stub = control_pb2_grpc.ControlServiceStub(self._channel)
        try:
            self._call = stub.WatchPressure(self.request)
            for msg in self._call:
                with self._lock:
                    self.messages.append(msg)
                    self.times.append(time.monotonic())
                self.subscribed.set()
            self.ended = Ended(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            self.ended = ended_from_error(err)
        finally:
            self.subscribed.set()

    def stop(self) -> None:
        if self._call is not None:
            with contextlib.suppress(Exception):
                self._call.cancel()
        self._thread.join(10)
        if self._channel is not None:
            self._channel.close()

    def snapshot(self) -> list[control_pb2.WatchPressureResponse]:
        with self._lock:
            return list(self.messages)

    def of_kind(self, kind: str) -> list[control_pb2.WatchPressureResponse]:
        return [m for m in self.snapshot() if m.WhichOneof("event") == kind]

    def transitions(self) -> list[control_pb2.PressureTransition]:
        return [m.transition for m in self.of_kind("transition")]

    def actions(self, kind: str | None = None) -> list[control_pb2.EnforcerAction]:
        acts = [m.action for m in self.of_kind("action")]
        return [a for a in acts if kind is None or kind_label(a.kind) == kind]

    def current_level(self) -> int | None:
        level = None
        for m in self.snapshot():
            which = m.WhichOneof("event")
            if which == "snapshot":
                level = m.snapshot.level
            elif which == "transition":
                level = m.transition.to_level
        return level

    def wait_level(self, levels: set[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.current_level() in levels:
                return True
            time.sleep(0.05)
        return self.current_level() in levels

    def problems(self) -> list[str]:
        """What is wrong with the stream: snapshot first, sequence, transition chain."""
        msgs = self.snapshot()
        out: list[str] = []
        if not msgs:
            return ["no message at all"]
        if msgs[0].WhichOneof("event") != "snapshot":
            out.append(f"first message is {msgs[0].WhichOneof('event')}, not a snapshot")
        # Numbers are per process: a coalesced sample leaves a gap, so only the order
        # is checked here; a lost transition shows as a break in the chain below.
        for prev, cur in zip(msgs, msgs[1:], strict=False):
            if cur.sequence <= prev.sequence:
                out.append(f"sequence not increasing {prev.sequence} -> {cur.sequence}")
        level = msgs[0].snapshot.level if msgs[0].WhichOneof("event") == "snapshot" else None
        for m in msgs:
            if m.WhichOneof("event") != "transition":
                continue
            t = m.transition
            if level is not None and t.from_level != level:
                out.append(
                    f"transition #{m.sequence} from {level_name(t.from_level)} but the "
                    f"previous level was {level_name(level)}"
                )
            if t.from_level == t.to_level:
                out.append(f"transition #{m.sequence} to the same level {level_name(t.to_level)}")
            level = t.to_level
        return out

    def misleveled_actions(
        self,
        kinds: tuple[str, ...] = (
            "evict_model",
            "abort_requests",
            "abort_load",
            "idle_reclaim",
            "pressure_reclaim",
        ),
    ) -> list[str]:
        """Actions whose `level` ("the level when it acted") differs from the level the
        stream itself was at (snapshot + transitions so far) when the action arrived."""
        out: list[str] = []
        level = None
        for m in self.snapshot():
            which = m.WhichOneof("event")
            if which == "snapshot":
                level = m.snapshot.level
            elif which == "transition":
                level = m.transition.to_level
            elif (
                which == "action"
                and kind_label(m.action.kind) in kinds
                and level is not None
                and m.action.level != level
            ):
                out.append(
                    f"#{m.sequence} {kind_label(m.action.kind)} {m.action.model_id} says level "
                    f"{level_name(m.action.level)} but the stream was at "
                    f"{level_name(level)}"
                )
        return out

    def describe(self, t0: float | None = None) -> str:
        """One line per message; with `t0` (monotonic), each prefixed by its arrival time."""
        lines = []
        for m, t in zip(self.snapshot(), self.times, strict=False):
            at = f"[{t - t0:5.1f}s] " if t0 is not None else ""
            which = m.WhichOneof("event")
            if which == "snapshot":
                s = m.snapshot
                lines.append(
                    f"  {at}#{m.sequence} snapshot {level_name(s.level)} usage "
                    f"{mib(s.readings.process_bytes)} ceiling {mib(s.limits.ceiling_bytes)}"
                    f" ({term_label(s.limits.binding_term)})"
                )
            elif which == "transition":
                t = m.transition
                lines.append(
                    f"  {at}#{m.sequence} transition {level_name(t.from_level)} -> "
                    f"{level_name(t.to_level)} usage {mib(t.readings.process_bytes)} "
                    f"soft {mib(t.limits.soft_bytes)} hard {mib(t.limits.hard_bytes)} "
                    f"ceiling {mib(t.limits.ceiling_bytes)} ({term_label(t.limits.binding_term)}): "
                    f"{t.reason}"
                )
            elif which == "action":
                a = m.action
                if kind_label(a.kind) in ("store_cache_cap",):
                    continue  # one per engine per tick: too chatty to print
                ids = f" requests={list(a.request_ids)}" if a.request_ids else ""
                entries = f" entries={a.entries_evicted}" if a.entries_evicted else ""
                lines.append(
                    f"  {at}#{m.sequence} action {kind_label(a.kind)} model={a.model_id or '-'}{ids} "
                    f"freed={mib(a.bytes_freed)}{entries} level={level_name(a.level)}: {a.reason}"
                )
        return "\n".join(lines)


@dataclass
class StatusPoint:
    at: float
    level: int
    process_bytes: int
    container_usage_bytes: int
    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int
    binding_term: str
    terms: dict[str, int]
    caps: dict[str, int]  # model id -> ModelInfo.store_cache_cap
    poll_interval_s: float
    pool_bytes: int = 0  # the MLX buffer pool (reclaimable)
    active_bytes: int = 0  # MLX active memory

    def line(self) -> str:
        terms = " ".join(f"{k}={v / MIB:.0f}" for k, v in sorted(self.terms.items()))
        return (
            f"{level_name(self.level):>9} usage {mib(self.process_bytes)} (mlx active "
            f"{mib(self.active_bytes)} pool {mib(self.pool_bytes)}) cgroup "
            f"{mib(self.container_usage_bytes)} soft {mib(self.soft_bytes)} hard "
            f"{mib(self.hard_bytes)} ceiling {mib(self.ceiling_bytes)} "
            f"[{self.binding_term}] terms(MiB) {terms} caps {self.caps}"
        )


CAP_FIELD = "store_cache_cap"


def kind_label(kind: int) -> str:
    return label(control_pb2.EnforcerActionKind, kind)


def term_label(term: int) -> str:
    return label(types_pb2.CeilingTerm, term)


def has_cap_field() -> bool:
    return CAP_FIELD in control_pb2.ModelInfo.DESCRIPTOR.fields_by_name


def status_point(status: control_pb2.GetMemoryStatusResponse) -> StatusPoint:
    r, lim = status.readings, status.limits
    caps = {}
    if has_cap_field():
        caps = {
            m.model_id: getattr(m, CAP_FIELD)
            for m in status.models
            if m.state == control_pb2.MODEL_STATE_READY
        }
    return StatusPoint(
        time.monotonic(),
        status.level,
        r.process_bytes,
        r.container_usage_bytes,
        lim.ceiling_bytes,
        lim.soft_bytes,
        lim.hard_bytes,
        term_label(lim.binding_term),
        {term_label(t.term): t.bytes for t in lim.terms},
        caps,
        status.poll_interval.ToNanoseconds() / 1e9,
        r.mlx_pool_bytes,
        r.mlx_active_bytes,
    )


class StatusPoller:
    """Calls GetMemoryStatus every `period_s` and keeps the points."""

    def __init__(self, address: str, period_s: float = 0.05) -> None:
        self.address = address
        self.period_s = period_s
        self.points: list[StatusPoint] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = control_pb2_grpc.ControlServiceStub(ch)
            while not self._stop.is_set():
                try:
                    point = status_point(
                        stub.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=5)
                    )
                    self.points.append(point)
                except grpc.RpcError as err:
                    self.errors.append(f"{err.code().name}: {err.details()}")
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        time.sleep(0.2)
                self._stop.wait(self.period_s)

    def latest(self) -> StatusPoint | None:
        return self.points[-1] if self.points else None

    def wait_for(
        self, predicate: Callable[[StatusPoint], bool], timeout: float, after: float | None = None
    ) -> StatusPoint | None:
        """The first point (newer than `after`) that satisfies predicate, or None."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            points = self.points
            for p in points[seen:]:
                if (after is None or p.at > after) and predicate(p):
                    return p
            seen = len(points)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
