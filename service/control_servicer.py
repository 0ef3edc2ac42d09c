"""ControlService: models, memory, pins, admission, sessions — wire ↔ the service's parts."""

from __future__ import annotations

from google.protobuf import duration_pb2

from engine import blas
from engine.errors import (
    InvalidArgument,
    PlimsollError,
    ResourceExhausted,
    Unavailable,
    under_field,
)
from engine.sources import check_source
from memory.plans import admission as adm
from memory.plans.admission import Verdict
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service import convert, status
from service.assembly import Service
from service.auth import SourcePolicy
from service.paging import page
from service.pressure_broker import PressurePublisher
from sessions.cold_tier import with_disk_entries

_VERDICTS = {
    Verdict.ADMIT: control_pb2.ADMIT_VERDICT_ADMIT,
    Verdict.ADMIT_AFTER_SHEDDING: control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING,
    Verdict.WAIT: control_pb2.ADMIT_VERDICT_WAIT,
    Verdict.REJECT: control_pb2.ADMIT_VERDICT_REJECT,
}
_CONSTRAINTS = {
    adm.BINDING_THRESHOLD: control_pb2.ADMIT_CONSTRAINT_SHED_LINE,
    adm.BINDING_CEILING: control_pb2.ADMIT_CONSTRAINT_ADMISSION_LIMIT,
    adm.BINDING_RESERVATIONS: control_pb2.ADMIT_CONSTRAINT_RESERVATIONS,
    adm.BINDING_PREFILL_EXCEEDS_CEILING: control_pb2.ADMIT_CONSTRAINT_PREFILL_EXCEEDS_CEILING,
    adm.BINDING_PAUSED_AT_SOFT: control_pb2.ADMIT_CONSTRAINT_PAUSED_AT_SOFT,
    adm.BINDING_PAUSED_AT_HARD: control_pb2.ADMIT_CONSTRAINT_PAUSED_AT_HARD,
    adm.BINDING_PAUSED_AT_EMERGENCY: control_pb2.ADMIT_CONSTRAINT_PAUSED_AT_EMERGENCY,
    adm.BINDING_QUEUE_FULL: control_pb2.ADMIT_CONSTRAINT_QUEUE_FULL,
    adm.BINDING_IN_FLIGHT_LIMIT: control_pb2.ADMIT_CONSTRAINT_IN_FLIGHT_LIMIT,
    adm.BINDING_HYPER_CAP: control_pb2.ADMIT_CONSTRAINT_HYPER_CAP,
    adm.BINDING_ADMISSION_CAP: control_pb2.ADMIT_CONSTRAINT_ADMISSION_CAP,
}


def _seconds(d: duration_pb2.Duration, field: str) -> float | None:
    s = d.ToNanoseconds() / 1e9
    if s < 0:
        raise InvalidArgument(f"{field} must not be negative", field)
    return s or None


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, service: Service, publisher: PressurePublisher,
                 sources: SourcePolicy | None = None) -> None:
        self._service = service
        self._sources = sources or SourcePolicy()  # LoadModel's model roots, --no-hub
        self._control = service.control
        self._publisher = publisher
        publisher.admission_state = lambda: convert.admission_to_wire(service.admission_figures())

    # -- models ---------------------------------------------------------------------
    async def ListModels(self, request, context):
        self._control.expire_leases()
        try:
            models, token = page(self._service.pool.entries(), lambda e: e.model_id,
                                 request.page_size, request.page_token)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.ListModelsResponse(
            models=[convert.model_to_wire(e) for e in models], next_page_token=token)

    async def LoadModel(self, request, context):
        try:
            check_source(request.source)  # a path no stat() can take, first
            self._sources.check(request.source)  # before anything reads the path
            keep_alive = (convert.keep_alive_from_wire(request.keep_alive)
                          if request.HasField("keep_alive") else None)
            entry = await self._control.load_model(request.source, request.model_id,
                                                   keep_alive)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.LoadModelResponse(model=convert.model_to_wire(entry))

    async def UnloadModel(self, request, context):
        try:
            if not request.model_id:
                raise InvalidArgument("model_id is empty: name the model to unload",
                                      "model_id")
            result, released = await self._control.unload_model(request.model_id,
                                                                 force=request.force)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.UnloadModelResponse(
            freed_bytes=result.freed_bytes, aborted_requests=result.aborted_requests,
            released_leases=released,
        )

    # -- admission ------------------------------------------------------------------------
    async def Admit(self, request, context):
        try:
            if not request.HasField("request"):
                raise InvalidArgument("request is empty: give the GenerateRequest to judge",
                                      "request")
            ttl = _seconds(request.reservation_ttl, "reservation_ttl")
            try:
                report = await self._service.pipeline.admit(
                    convert.spec_from_wire(request.request), request.reserve, ttl,
                    request.client_request_id, request.owner)
            except PlimsollError as err:
                raise under_field(err, "request") from None
        except Exception as err:
            await status.abort(context, err)
        return _admit_to_wire(report)

    # -- pins -----------------------------------------------------------------------------
    async def Pin(self, request, context):
        try:
            ttl = _seconds(request.ttl, "ttl")
            target = request.WhichOneof("target")
            crid = request.client_request_id
            if target == "model_id" and request.model_id:
                held = await self._control.pin_model(request.model_id, request.owner, ttl, crid)
            elif target == "session_id" and request.session_id:
                held = self._control.pin_session(request.session_id, request.owner, ttl, crid)
            else:
                raise InvalidArgument("target: set model_id or session_id", "target")
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.PinResponse(lease=convert.lease_to_wire(held))

    async def Unpin(self, request, context):
        try:
            if not request.lease_id:
                raise InvalidArgument("lease_id is empty", "lease_id")
            held = self._control.unpin(request.lease_id)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.UnpinResponse(lease=convert.lease_to_wire(held))

    # -- pressure -----------------------------------------------------------------------
    async def _snapshot(self) -> control_pb2.PressureSnapshot:
        snapshot = self._publisher.snapshot()
        if snapshot is None:  # before the first tick: take one now
            await self._service.governor.tick()
            snapshot = self._publisher.snapshot()
        if snapshot is None:
            raise Unavailable("memory could not be measured yet; retry", retry_after_s=1.0,
                                  reason="MEMORY_NOT_MEASURED")
        return snapshot

    async def WatchPressure(self, request, context):
        try:
            if self._publisher.snapshot() is None:
                await self._snapshot()
            sub = self._publisher.subscribe(request.include_samples, request.include_actions,
                                            request.resume_after_sequence,
                                            resume_instance=request.resume_instance)
            if sub is None:
                raise Unavailable("memory could not be measured yet; retry", retry_after_s=1.0,
                                  reason="MEMORY_NOT_MEASURED")
        except Exception as err:
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
        try:
            return await self.memory_status()
        except Exception as err:
            await status.abort(context, err)

    async def memory_status(self) -> control_pb2.GetMemoryStatusResponse:
        """GetMemoryStatus's answer; the web dashboard's /api/status too."""
        svc = self._service
        self._control.expire_leases()
        snap = await self._snapshot()
        gov = svc.governor
        return control_pb2.GetMemoryStatusResponse(
            level=snap.level,
            readings=snap.readings,
            limits=snap.limits,
            models=[convert.model_to_wire(e) for e in svc.pool.entries()],
            leases=[convert.lease_to_wire(h) for h in svc.leases.leases()],
            enforcer_enabled=gov.config.enabled,
            poll_interval=convert.duration(gov.poll_interval),
            admission=convert.admission_to_wire(svc.admission_figures()),
            blas=_blas_to_wire(blas.state()),
            session_disk=(convert.session_disk_to_wire(svc.cold.stats())
                          if svc.cold is not None else None),
        )

    # -- sessions ---------------------------------------------------------------------------
    async def ListSessions(self, request, context):
        svc = self._service
        pinned = svc.leases.pinned_sessions()
        try:
            model = request.model_id or None
            infos, token = page(with_disk_entries(svc.bank.list_sessions(model), svc.cold, model,
                                                  svc.active_sessions()),
                                lambda s: s.session_id or "", request.page_size,
                                request.page_token)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.ListSessionsResponse(
            sessions=[convert.session_to_wire(s, s.session_id in pinned) for s in infos],
            total_bytes=svc.bank.total_bytes(), next_page_token=token,
            session_disk=(convert.session_disk_to_wire(svc.cold.stats())
                          if svc.cold is not None else None))

    async def DropSession(self, request, context):
        try:
            if not request.session_id:
                raise InvalidArgument("session_id is empty", "session_id")
            entries, freed = self._control.drop_session(request.session_id)
        except Exception as err:
            await status.abort(context, err)
        return control_pb2.DropSessionResponse(entries_dropped=entries, bytes_freed=freed)



def _admit_to_wire(report) -> control_pb2.AdmitResponse:
    result = report.result
    d = result.decision
    inputs = d.inputs
    resp = control_pb2.AdmitResponse(
        verdict=_VERDICTS[report.verdict],
        projected_bytes=max(0, d.projected_bytes),
        usage_bytes=max(0, inputs.usage_bytes),
        request_bytes=max(0, adm.own_bytes(inputs)),
        reserved_bytes=inputs.reserved_bytes,
        admission_limit_bytes=min(inputs.ceiling_bytes, adm.UNLIMITED_BYTES),
        admission_headroom_bytes=d.headroom_bytes,
        pressure_level=int(result.level),
        reusable_prefix_tokens=inputs.reusable_prefix_tokens,
        shed_entries=result.shed_entries,
        shed_bytes=result.shed_bytes,
        binding_constraint=_CONSTRAINTS.get(report.binding or "", 0),
        reason=report.reason,
        error_reason=(report.error_reason or "") if not _admits(report.verdict) else "",
    )
    if report.retry_after_s and not _admits(report.verdict):
        resp.retry_after.CopyFrom(convert.duration(report.retry_after_s))
    if report.reserved is not None:
        held = report.reserved.reservation
        resp.ticket = held.ticket
        resp.ticket_expire_time.CopyFrom(convert.timestamp(report.ticket_expires_at))
        resp.reservation_ttl.CopyFrom(convert.duration(held.ttl_s))
    return resp


def _admits(verdict: Verdict) -> bool:
    return verdict in (Verdict.ADMIT, Verdict.ADMIT_AFTER_SHEDDING)


def _blas_to_wire(state: blas.BlasState) -> control_pb2.BlasInfo:
    return control_pb2.BlasInfo(name=state.name, version=state.version,
                                description=state.description, threads=state.threads,
                                optimized=state.optimized, reason=state.reason)
