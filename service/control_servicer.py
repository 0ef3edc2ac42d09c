"""ControlService: models, memory, pins, admission, sessions — wire ↔ the service's parts."""

from __future__ import annotations

from google.protobuf import duration_pb2

from engine.errors import InvalidArgument, PlimsollError, ResourceExhausted, Unavailable
from memory.plans.admission import Verdict
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service import convert, status
from service.assembly import Service
from service.pressure_broker import PressurePublisher

_VERDICTS = {
    Verdict.ADMIT: control_pb2.ADMIT_VERDICT_ADMIT,
    Verdict.ADMIT_AFTER_SHEDDING: control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING,
    Verdict.WAIT: control_pb2.ADMIT_VERDICT_WAIT,
    Verdict.REJECT: control_pb2.ADMIT_VERDICT_REJECT,
}


def _seconds(d: duration_pb2.Duration, field: str) -> float | None:
    s = d.ToNanoseconds() / 1e9
    if s < 0:
        raise InvalidArgument(f"{field} must not be negative", field)
    return s or None


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, service: Service, publisher: PressurePublisher) -> None:
        self._service = service
        self._control = service.control
        self._publisher = publisher

    # -- models ---------------------------------------------------------------------
    async def ListModels(self, request, context):
        self._control.expire_leases()
        return control_pb2.ListModelsResponse(
            models=[convert.model_to_wire(e) for e in self._service.pool.entries()]
        )

    async def LoadModel(self, request, context):
        try:
            entry = await self._control.load_model(request.source, request.id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.LoadModelResponse(model=convert.model_to_wire(entry))

    async def UnloadModel(self, request, context):
        try:
            if not request.id:
                raise InvalidArgument("id is empty: name the model to unload", "id")
            result = await self._control.unload_model(request.id, force=request.force)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.UnloadModelResponse(
            freed_bytes=result.freed_bytes, aborted_requests=result.aborted_requests
        )

    # -- admission ------------------------------------------------------------------------
    async def Admit(self, request, context):
        try:
            if not request.HasField("request"):
                raise InvalidArgument("request is empty: give the GenerateRequest to judge",
                                      "request")
            spec = convert.spec_from_wire(request.request)
            ttl = _seconds(request.reservation_ttl, "reservation_ttl")
            report = await self._service.pipeline.admit(spec, request.reserve, ttl)
        except PlimsollError as err:
            await status.abort(context, err)
        result = report.result
        d = result.decision
        resp = control_pb2.AdmitResponse(
            verdict=_VERDICTS[result.verdict],
            projected_bytes=max(0, d.projected_bytes),
            headroom_bytes=d.headroom_bytes,
            pressure_level=int(result.level),
            reusable_prefix_tokens=d.inputs.reusable_prefix_tokens,
            shed_entries=result.shed_entries,
            shed_bytes=result.shed_bytes,
            binding_constraint=result.binding or "",
            reason=result.reason,
            ticket=report.ticket,
        )
        if result.retry_after_s and not result.admitted:
            resp.retry_after.CopyFrom(_duration(result.retry_after_s))
        if report.ticket:
            resp.ticket_expires_at.CopyFrom(convert.timestamp(report.ticket_expires_at))
        return resp

    # -- pins -----------------------------------------------------------------------------
    async def Pin(self, request, context):
        try:
            ttl = _seconds(request.ttl, "ttl")
            target = request.WhichOneof("target")
            if target == "model" and request.model:
                held = await self._control.pin_model(request.model, request.owner, ttl)
            elif target == "session_id" and request.session_id:
                held = self._control.pin_session(request.session_id, request.owner, ttl)
            else:
                raise InvalidArgument("target: set model or session_id", "target")
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.PinResponse(lease=convert.lease_to_wire(held))

    async def Unpin(self, request, context):
        try:
            if not request.lease_id:
                raise InvalidArgument("lease_id is empty", "lease_id")
            held = self._control.unpin(request.lease_id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.UnpinResponse(lease=convert.lease_to_wire(held))

    # -- pressure -----------------------------------------------------------------------
    async def _snapshot(self) -> control_pb2.PressureSnapshot:
        snapshot = self._publisher.snapshot()
        if snapshot is None:  # before the first tick: take one now
            await self._service.governor.tick()
            snapshot = self._publisher.snapshot()
        if snapshot is None:
            raise Unavailable("memory could not be measured yet; retry", retry_after_s=1.0)
        return snapshot

    async def WatchPressure(self, request, context):
        try:
            if self._publisher.snapshot() is None:
                await self._snapshot()
            sub = self._publisher.subscribe(request.include_samples, request.include_actions)
            if sub is None:
                raise Unavailable("memory could not be measured yet; retry", retry_after_s=1.0)
        except PlimsollError as err:
            await status.abort(context, err)
        broker = self._publisher.broker
        try:
            while True:
                msg = await sub.next()
                if msg is None:
                    break
                yield msg
            if sub.overflowed:
                await status.abort(context, ResourceExhausted(
                    f"subscriber fell {sub.capacity} events behind; re-subscribe for a "
                    "fresh snapshot", reason="SUBSCRIBER_OVERFLOW", retry_after_s=0.0))
        finally:
            broker.unsubscribe(sub)

    async def GetMemoryStatus(self, request, context):
        svc = self._service
        self._control.expire_leases()
        try:
            snap = await self._snapshot()
        except PlimsollError as err:
            await status.abort(context, err)
        gov = svc.governor
        return control_pb2.GetMemoryStatusResponse(
            level=snap.level,
            readings=snap.readings,
            limits=snap.limits,
            models=[convert.model_to_wire(e) for e in svc.pool.entries()],
            leases=[convert.lease_to_wire(h) for h in svc.leases.leases()],
            enforcer_enabled=gov.config.enabled,
            poll_interval_seconds=gov.poll_interval,
            admission_paused=gov.admission_paused,
            session_bank_bytes=svc.bank.total_bytes(),
        )

    # -- sessions ---------------------------------------------------------------------------
    async def ListSessions(self, request, context):
        svc = self._service
        pinned = svc.leases.pinned_sessions()
        sessions = [convert.session_to_wire(s, s.session_id in pinned)
                    for s in svc.bank.list_sessions(request.model or None)]
        return control_pb2.ListSessionsResponse(sessions=sessions,
                                                total_bytes=svc.bank.total_bytes())

    async def DropSession(self, request, context):
        try:
            if not request.session_id:
                raise InvalidArgument("session_id is empty", "session_id")
            entries, freed = self._control.drop_session(request.session_id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.DropSessionResponse(entries_dropped=entries, bytes_freed=freed)

