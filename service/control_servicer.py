"""ControlService: models, memory, pins, admission, sessions — wire ↔ runtime."""

from __future__ import annotations

from google.protobuf import duration_pb2

from engine.errors import InvalidArgument, PlimsollError, ResourceExhausted
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service import convert, status
from service.pressure_broker import PressureBroker
from service.runtime import Runtime
from sessions.admission import Verdict

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
    def __init__(self, runtime: Runtime, broker: PressureBroker) -> None:
        self._runtime = runtime
        self._broker = broker

    # -- models ---------------------------------------------------------------------
    async def ListModels(self, request, context):
        self._runtime.expire_leases()
        return control_pb2.ListModelsResponse(
            models=[convert.model_to_wire(e) for e in self._runtime.pool.entries()]
        )

    async def LoadModel(self, request, context):
        try:
            entry = await self._runtime.load_model(request.source, request.id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.LoadModelResponse(model=convert.model_to_wire(entry))

    async def UnloadModel(self, request, context):
        try:
            if not request.id:
                raise InvalidArgument("id is empty: name the model to unload", "id")
            result = await self._runtime.unload_model(request.id, force=request.force)
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
            report = self._runtime.admit(spec, request.reserve, ttl)
        except PlimsollError as err:
            await status.abort(context, err)
        d = report.decision
        resp = control_pb2.AdmitResponse(
            verdict=_VERDICTS[d.verdict],
            projected_bytes=max(0, d.projected_bytes),
            headroom_bytes=d.headroom_bytes,
            pressure_level=report.level,
            reusable_prefix_tokens=d.inputs.reusable_prefix_tokens,
            shed_entries=report.shed_entries,
            shed_bytes=report.shed_bytes,
            binding_constraint=d.binding or "",
            reason=d.reason,
            ticket=report.ticket,
        )
        if d.retry_after_s:
            resp.retry_after.CopyFrom(_duration(d.retry_after_s))
        if report.ticket:
            resp.ticket_expires_at.CopyFrom(convert.timestamp(report.ticket_expires_at))
        return resp

    # -- pins -----------------------------------------------------------------------------
    async def Pin(self, request, context):
        try:
            ttl = _seconds(request.ttl, "ttl")
            target = request.WhichOneof("target")
            if target == "model" and request.model:
                lease = await self._runtime.pin_model(request.model, request.owner, ttl)
                wire = convert.model_lease_to_wire(lease)
            elif target == "session_id" and request.session_id:
                pin = self._runtime.pin_session(request.session_id, request.owner, ttl)
                wire = convert.session_pin_to_wire(pin)
            else:
                raise InvalidArgument("target: set model or session_id", "target")
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.PinResponse(lease=wire)

    async def Unpin(self, request, context):
        try:
            if not request.lease_id:
                raise InvalidArgument("lease_id is empty", "lease_id")
            lease = self._runtime.unpin(request.lease_id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.UnpinResponse(lease=convert.lease_to_wire(lease))

    # -- pressure -----------------------------------------------------------------------
    def _snapshot(self) -> control_pb2.PressureSnapshot:
        rt = self._runtime
        enf = rt.enforcer
        if enf is not None and enf.readings is not None and enf.limits is not None:
            readings, limits = enf.readings, enf.limits
        else:
            readings, limits = rt.measure()
        return control_pb2.PressureSnapshot(
            level=convert.level_to_wire(rt.level, enf.emergency if enf else False),
            readings=convert.readings_to_wire(readings),
            limits=convert.limits_to_wire(limits),
        )

    async def WatchPressure(self, request, context):
        sub = self._broker.subscribe(self._snapshot(), request.include_samples,
                                     request.include_actions)
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
            self._broker.unsubscribe(sub)

    async def GetMemoryStatus(self, request, context):
        rt = self._runtime
        rt.expire_leases()
        snap = self._snapshot()
        leases = [convert.model_lease_to_wire(x) for x in rt.model_leases.leases()]
        leases += [convert.session_pin_to_wire(p) for p in rt.session_pins.leases()]
        return control_pb2.GetMemoryStatusResponse(
            level=snap.level,
            readings=snap.readings,
            limits=snap.limits,
            models=[convert.model_to_wire(e) for e in rt.pool.entries()],
            leases=leases,
            enforcer_enabled=rt.enforcer is not None,
            poll_interval_seconds=rt.enforcer.poll_interval if rt.enforcer else 0.0,
            admission_paused=rt.enforcer.admission_paused if rt.enforcer else False,
            session_bank_bytes=rt.bank.total_bytes(),
        )

    # -- sessions ---------------------------------------------------------------------------
    async def ListSessions(self, request, context):
        rt = self._runtime
        pinned = rt.session_pins.active_ids()
        sessions = [convert.session_to_wire(s, s.session_id in pinned)
                    for s in rt.bank.list_sessions(request.model or None)]
        return control_pb2.ListSessionsResponse(sessions=sessions,
                                                total_bytes=rt.bank.total_bytes())

    async def DropSession(self, request, context):
        try:
            if not request.session_id:
                raise InvalidArgument("session_id is empty", "session_id")
            entries, freed = self._runtime.drop_session(request.session_id)
        except PlimsollError as err:
            await status.abort(context, err)
        return control_pb2.DropSessionResponse(entries_dropped=entries, bytes_freed=freed)

