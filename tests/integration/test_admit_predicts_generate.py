"""Admit predicts Generate: for random server states, what Admit says Generate would
do at that instant is what Generate then does, with or without a ticket.

Real gRPC over loopback to a real server on the tiny demo model; readings are
scripted (a `ScriptedReader` stands in for /proc), so the level and the memory
room are exact, and the test runs every governor tick itself. A state is drawn
from: the ticked level (ok, soft, hard), usage moving near the admission limit
after the tick (between ticks), the prompt size, other clients' reservations,
requests parked in the admission queue, the queue and in-flight limits, and
whether the probe redeems its own Admit ticket.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from memory.config import MemoryConfig
from memory.governor import ADMISSION_READING_SHARE_S
from memory.levels import Tier
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.assembly import ServiceSettings
from service.server import PlimsollServer, ServerConfig
from tests.support.memory_fakes import ScriptedReader, readings

# Custom tier, 1 GiB: soft 0.85, hard 0.95; admission limit 0.95 (the custom tier's
# pre-chunk margin). A 3,000-token prompt on the tiny model projects ~50 MiB.
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=1, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600)
LEVEL_GIB = {"ok": 0.5, "soft": 0.88, "hard": 0.96}
NEAR_LIMIT_GIB = (0.84, 0.91, 0.93)  # after the tick: the level stays what the tick saw
STATES = int(os.environ.get("PLIMSOLL_ADMIT_STATES", "40"))
ADMITS = (control_pb2.ADMIT_VERDICT_ADMIT, control_pb2.ADMIT_VERDICT_ADMIT_AFTER_SHEDDING)
IMMEDIATE = (control_pb2.ADMIT_CONSTRAINT_QUEUE_FULL, control_pb2.ADMIT_CONSTRAINT_IN_FLIGHT_LIMIT)


@dataclass(frozen=True)
class State:
    level: str
    after_tick_gib: float | None
    prompt_tokens: int
    others_reserved: int
    parked: int
    queue_limit: int
    in_flight_limit: int
    ticket: bool

    @classmethod
    def draw(cls, rnd: random.Random) -> State:
        level = rnd.choice(list(LEVEL_GIB))
        return cls(
            level=level,
            after_tick_gib=rnd.choice((None, *NEAR_LIMIT_GIB)) if level == "ok" else None,
            prompt_tokens=rnd.choice((8, 3000)),
            others_reserved=rnd.choice((0, 0, 1, 3)),
            parked=rnd.choice((0, 1, 2)) if level != "ok" else 0,
            queue_limit=rnd.choice((1, 4)),
            in_flight_limit=rnd.choice((2, 8)),
            ticket=rnd.random() < 0.5,
        )


def request(tokens: int, seed: int) -> inference_pb2.GenerateRequest:
    ids = [5 + (seed * 7 + i) % 900 for i in range(tokens)]
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=ids),
                                         max_tokens=4, ignore_eos=True)


def reason_of(err: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


# A request seen parked in the admission queue and still silent this long is waiting (the
# test runs every tick itself, so nothing can release it meanwhile).
PARKED_HOLD_S = 0.1


async def first_message(call, timeout: float, parked=None):
    """('start', msg) | ('status', code, reason) | ('waiting',) after `timeout`, or, with
    `parked` (a predicate), PARKED_HOLD_S after it holds if that comes first."""
    loop = asyncio.get_running_loop()
    read = asyncio.ensure_future(call.read())
    deadline = loop.time() + timeout
    if parked is not None:
        while not read.done() and not parked() and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if parked():
            deadline = min(deadline, loop.time() + PARKED_HOLD_S)
    done, _ = await asyncio.wait({read}, timeout=max(0.0, deadline - loop.time()))
    if not done:
        read.cancel()
        return ("waiting",)
    try:
        msg = read.result()
    except grpc.aio.AioRpcError as err:
        return ("status", err.code(), reason_of(err))
    if msg is grpc.aio.EOF:
        try:
            await call
        except grpc.aio.AioRpcError as err:
            return ("status", err.code(), reason_of(err))
        return ("eof",)
    return ("start", msg)


async def test_admit_predicts_generate_for_random_states(demo_path):
    reader = ScriptedReader(readings(LEVEL_GIB["ok"]))
    settings = ServiceSettings(admission_timeout_s=30.0, reservation_ttl_s=60.0)
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)], memory=CONFIG,
                                         service=settings), reader=reader)
    await server.start()
    await server.load_initial_models()
    svc = server.service
    gov = svc.governor
    gov.stop()
    # Pinned, so hard pressure does not unload the one model (seed 000 would).
    (model,) = svc.pool.entries()
    await svc.control.pin_model(model.model_id, "admit-property", None)
    rnd = random.Random(int(os.environ.get("PLIMSOLL_ADMIT_SEED", "8")))
    tried: dict[str, int] = {}
    mismatches: list[str] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            for n in range(STATES):
                state = State.draw(rnd)
                verdict, observed = await probe(server, reader, control, inference, state, n)
                key = f"{verdict[0].removeprefix('ADMIT_VERDICT_')}/{verdict[1]} -> " + \
                    "/".join(observed)
                tried[key] = tried.get(key, 0) + 1
                if not agrees(verdict, observed):
                    mismatches.append(f"state {n} {state}: Admit {verdict} but Generate "
                                      f"{observed}")
    finally:
        await server.drain()
    print(f"\nAdmit vs Generate over {STATES} random states: {tried}")
    assert not mismatches, "\n".join(mismatches)
    # The draw reaches every kind of answer (else the property proves little).
    seen = " ".join(tried)
    for kind in ("ADMIT/", "WAIT/", "REJECT/"):
        assert kind in seen, tried


def agrees(verdict: tuple, observed: tuple) -> bool:
    name, constraint, error_reason = verdict
    if name in ("ADMIT_VERDICT_ADMIT", "ADMIT_VERDICT_ADMIT_AFTER_SHEDDING"):
        return observed[0] == "start"
    if name == "ADMIT_VERDICT_WAIT" and constraint not in ("QUEUE_FULL", "IN_FLIGHT_LIMIT"):
        return observed == ("waiting",)
    return observed == ("status", "RESOURCE_EXHAUSTED", error_reason)


async def probe(server, reader, control, inference, state: State, n: int):
    svc = server.service
    gov = svc.governor
    svc.pipeline.settings.max_queued_requests = state.in_flight_limit
    svc.queue.queue_limit = state.queue_limit
    background: list = []
    tickets: list[str] = []
    try:
        # Other clients' tickets, taken while there is room.
        reader.current = readings(LEVEL_GIB["ok"])
        await gov.tick()
        for i in range(state.others_reserved):
            r = await control.Admit(control_pb2.AdmitRequest(
                request=request(3000, 1000 + n * 10 + i), reserve=True))
            tickets.append(r.ticket)
        # The level the tick grades, requests parked in the paused queue, then
        # usage moving between ticks.
        reader.current = readings(LEVEL_GIB[state.level])
        await gov.tick()
        for i in range(state.parked):
            call = inference.Generate(request(8, 2000 + n * 10 + i))
            background.append(call)
        await wait_for_parked(svc, state)
        if state.after_tick_gib is not None:
            reader.current = readings(state.after_tick_gib)
            # Past the window in which admissions share the tick's reading.
            await asyncio.sleep(2 * ADMISSION_READING_SHARE_S)
        req = request(state.prompt_tokens, n)
        admit = await control.Admit(control_pb2.AdmitRequest(request=req, reserve=state.ticket))
        if admit.ticket:
            req.admission_ticket = admit.ticket
        verdict = (control_pb2.AdmitVerdict.Name(admit.verdict),
                   control_pb2.AdmitConstraint.Name(admit.binding_constraint)
                   .removeprefix("ADMIT_CONSTRAINT_"), admit.error_reason)
        before = svc.queue.waiting
        call = inference.Generate(req)
        background.append(call)
        if verdict[0] == "ADMIT_VERDICT_WAIT":
            got = await first_message(call, 0.5, parked=lambda: svc.queue.waiting > before)
        else:
            got = await first_message(call, 20)
        observed = (got[0], got[1].name, got[2]) if got[0] == "status" else got[:1]
        return verdict, observed
    finally:
        for call in background:
            call.cancel()
        for t in tickets:
            svc.reservations.redeem(t)
        reader.current = readings(LEVEL_GIB["ok"])
        await gov.tick()
        await settle(svc)


async def wait_for_parked(svc, state: State) -> None:
    want = min(state.parked, state.queue_limit, state.in_flight_limit)
    for _ in range(200):
        if svc.queue.waiting >= want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{want} requests never parked in the queue")


async def settle(svc) -> None:
    """Until cancelled requests have left the pipeline and the engine."""
    for _ in range(500):
        engines = [e.engine for e in svc.pool.entries() if e.engine is not None]
        if svc.pipeline.in_flight == 0 and not any(e.stats.active_requests for e in engines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still in flight after cancel")
