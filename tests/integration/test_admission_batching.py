"""Requests that arrive together are admitted together: one governor measurement for
the burst, each request decided in order seeing the ones admitted before it.

Real gRPC over loopback to a real server on the tiny demo model, readings scripted
(`ScriptedReader`) so the memory room is exact: it fits two of four equal prompts.
Sequential Admits that reserve what they admit predict the burst (each sees the
earlier ones' tickets as the burst's requests see the earlier admissions): two
ADMIT, two REJECT; the Generates sent together then start two and refuse two with
RESOURCE_EXHAUSTED, after exactly one measurement.
"""

from __future__ import annotations

import asyncio

import grpc

from memory.config import MemoryConfig
from memory.levels import GIB, PressureLevel, Tier
from memory.plans.admission import (
    AdmissionRequest,
    AdmissionSettings,
    Verdict,
    admission_batch_plan,
    admission_plan,
)
from memory.plans.steps import Measure, Snapshot
from memory.readings import MemoryReadings
from memory.views import BankFigures
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2_grpc
from service.assembly import ServiceSettings
from service.server import PlimsollServer, ServerConfig
from tests.integration.test_admit_predicts_generate import first_message, request
from tests.support.memory_fakes import ScriptedReader, drive, readings

CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=1, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600)
BURST = 4
PROMPT = 3000  # tokens: ~50 MiB projected on the tiny model


async def test_a_burst_is_admitted_through_one_measurement(demo_path):
    reader = ScriptedReader(readings(0.5))
    settings = ServiceSettings(admission_timeout_s=30.0, reservation_ttl_s=60.0)
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)], memory=CONFIG,
                                         service=settings), reader=reader)
    await server.start()
    await server.load_initial_models()
    svc = server.service
    gov = svc.governor
    gov.stop()
    (model,) = svc.pool.entries()
    await svc.control.pin_model(model.model_id, "batching", None)
    calls: list = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            await gov.tick()
            probe = await control.Admit(control_pb2.AdmitRequest(request=request(PROMPT, 99)))
            own, limit = probe.request_bytes, probe.admission_limit_bytes
            assert own > 0 and probe.verdict == control_pb2.ADMIT_VERDICT_ADMIT
            # Room for two and a half of them; the level stays ok.
            reader.current = readings((limit - 2.5 * own) / GIB)
            await gov.tick()
            assert gov.level is PressureLevel.OK

            # What Admit predicts, each seeing the ones before it (as reservations).
            predicted, tickets = [], []
            for i in range(BURST):
                r = await control.Admit(control_pb2.AdmitRequest(request=request(PROMPT, i),
                                                                 reserve=True))
                predicted.append(r.verdict)
                if r.ticket:
                    tickets.append(r.ticket)
            for t in tickets:
                svc.reservations.redeem(t)
            admit, reject = control_pb2.ADMIT_VERDICT_ADMIT, control_pb2.ADMIT_VERDICT_REJECT
            assert predicted == [admit, admit, reject, reject], predicted

            measured: list = []
            executor = gov._executor
            real_measure = executor.measure

            async def counting(query=None, *args, **kwargs):
                if query is not None:
                    measured.append(query)
                return await real_measure(query, *args, **kwargs)

            executor.measure = counting
            try:
                # Hold the decision lock while the four arrive: they form one burst.
                async with gov._lock():
                    calls = [inference.Generate(request(PROMPT, i)) for i in range(BURST)]
                    for _ in range(500):
                        if len(gov._burst) == BURST:
                            break
                        await asyncio.sleep(0.01)
                    assert len(gov._burst) == BURST
                got = [await first_message(c, 20) for c in calls]
            finally:
                executor.measure = real_measure
            assert len(measured) == 1, measured
            assert len(measured[0].more) == BURST - 1
            started = [g for g in got if g[0] == "start"]
            refused = [g for g in got if g[0] == "status"]
            assert len(started) == 2 and len(refused) == 2, got
            for _, code, reason in refused:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert reason == "MEMORY_PRESSURE"
    finally:
        for c in calls:
            c.cancel()
        await server.drain()


def test_one_request_batch_plan_is_the_admission_plan():
    """A burst of one takes exactly admission_plan's steps and result."""
    req = AdmissionRequest(model="m", prompt_tokens=tuple(range(100)), max_tokens=10,
                           kv_bytes_per_token=1 << 20)
    snap = Snapshot(readings=MemoryReadings(process_bytes=GIB // 2, system_total_bytes=64 * GIB),
                    bank=BankFigures())
    one = drive(admission_plan(req, CONFIG, AdmissionSettings(), PressureLevel.OK), snap)
    batch = drive(admission_batch_plan([req], CONFIG, AdmissionSettings(), PressureLevel.OK),
                  snap)
    assert batch.result == (one.result,)
    assert [type(s) for s in batch.steps] == [type(s) for s in one.steps]


def test_batch_plan_measures_once_and_counts_earlier_admissions():
    reqs = [AdmissionRequest(model="m", prompt_tokens=(i,) * 1000, max_tokens=0,
                             kv_bytes_per_token=1 << 17, holds_slot=True) for i in range(5)]
    # ~125 MiB each (plus a small transient): a few fit above 0.5 GiB, not all five.
    snap = Snapshot(readings=MemoryReadings(process_bytes=GIB // 2, system_total_bytes=64 * GIB),
                    bank=BankFigures(), more_banks=(BankFigures(),) * 4)
    d = drive(admission_batch_plan(reqs, CONFIG, AdmissionSettings(), PressureLevel.OK), snap)
    assert sum(isinstance(s, Measure) for s in d.steps) == 1
    verdicts = [r.verdict for r in d.result]
    own = d.result[0].decision.request_bytes
    fits = int((d.result[0].decision.inputs.ceiling_bytes - GIB // 2) // own)
    assert 0 < fits < len(reqs)
    assert verdicts == [Verdict.ADMIT] * fits + [Verdict.REJECT] * (len(reqs) - fits)
    # Each one's projection includes the ones admitted before it.
    for k, r in enumerate(d.result[:fits]):
        assert r.decision.inputs.burst_bytes == k * own
