"""Record a real pressure episode with `plimsoll watch --record` and draw it with
`plimsoll plot` (docs/episode.jsonl and docs/episode.png are made this way).

The server runs in a child memory cgroup (tools.harness.cgroup; root and a memory
controller needed) serving the medium demo model, with a small demo model loaded beside
it and a few cached sessions. Nothing inside the server is faked: the test lowers the
cgroup's limit, so the ceiling's container term (the limit less its reserve) falls
toward what the server really uses, and the enforcer reacts as it would in production:

1. ok for a few seconds;
2. a long generation starts; then the squeeze: the ceiling becomes usage / SOFT_RATIO,
   inside the soft band (admissions pause, the idle small model is evicted, caps walk
   down, the running request goes on);
3. squeeze harder: the ceiling becomes usage / HARD_RATIO, at or above the hard mark
   (session caches shrink, the running request is aborted);
4. release: the limit goes back up and the level returns to ok.

Run from a checkout, as root::

    .venv/bin/python -m tools.record_episode --out docs/episode.jsonl --png docs/episode.png
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2, inference_pb2, inference_pb2_grpc
from tools.harness.cgroup import ChildCgroup, limit_for_ceiling
from tools.harness.server import ROOT, ServerProcess, start_server

MIB = 1 << 20
LIMIT_BYTES = 2048 * MIB
SOFT_FRACTION = 0.6  # a wide soft band (0.6 to 0.95 of the ceiling)
SOFT_RATIO = 0.8  # usage / ceiling while squeezed to soft
HARD_RATIO = 0.97  # usage / ceiling while squeezed to hard
POLL_S = 0.5
PHASES_S = {"ok": 5.0, "soft": 8.0, "hard": 8.0, "release": 6.0}


def warm(folder: Path) -> None:
    """Read the model files here, so their page cache is charged to this process's cgroup,
    not the server's: the child cgroup then holds only the server's own memory."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                while fh.read(8 * MIB):
                    pass


def usage_and_total(srv: ServerProcess) -> tuple[int, int]:
    with srv.stubs() as (control, _):
        st = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=10)
    return st.readings.process_bytes, st.readings.system_total_bytes


def squeeze(cg: ChildCgroup, srv: ServerProcess, ratio: float) -> None:
    usage, total = usage_and_total(srv)
    limit = limit_for_ceiling(int(usage / ratio), total)
    print(f"[episode] usage {usage / MIB:.0f} MiB: limit -> {limit / MIB:.0f} MiB "
          f"(ceiling ~ usage / {ratio})", flush=True)
    cg.set_limit(limit)


def fill_sessions(srv: ServerProcess, model: str, count: int = 3) -> None:
    with srv.stubs() as (_, inference):
        for i in range(count):
            req = inference_pb2.GenerateRequest(
                model_id=model, text="the ship sails on the sea " * 60, max_tokens=16,
                session_id=f"episode-{i}")
            list(inference.Generate(req, timeout=120))


def long_generation(address: str, model: str) -> threading.Thread:
    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            req = inference_pb2.GenerateRequest(model_id=model, text="once upon a time " * 20,
                                                max_tokens=3000, ignore_eos=True)
            try:
                for _ in inference_pb2_grpc.InferenceServiceStub(ch).Generate(req, timeout=120):
                    pass
                print("[episode] the long generation finished", flush=True)
            except grpc.RpcError as err:
                print(f"[episode] the long generation ended {err.code().name}: "
                      f"{err.details()}", flush=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.record_episode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/episode.jsonl"))
    p.add_argument("--png", type=Path, default=Path("docs/episode.png"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = p.parse_args(argv)

    medium, small = ensure_demo_model("medium"), ensure_demo_model("small")
    warm(medium)
    warm(small)
    cg = ChildCgroup.create(LIMIT_BYTES)
    srv = None
    watcher = None
    try:
        srv = start_server(args.log_dir, "--model", str(medium), "--memory-guard-gb", "8",
                           "--soft-fraction", str(SOFT_FRACTION), "--max-num-seqs", "4",
                           "--load-warmup", "0", "--poll-active", str(POLL_S),
                           "--poll-idle", str(POLL_S), "--poll-empty", str(POLL_S),
                           prefix=cg.prefix())
        with srv.stubs() as (control, _):
            default = next(m.model_id for m in control.ListModels(
                control_pb2.ListModelsRequest(), timeout=30).models if m.is_default)
            control.LoadModel(control_pb2.LoadModelRequest(source=str(small), model_id="small"),
                              timeout=120)
        fill_sessions(srv, default)
        duration = sum(PHASES_S.values()) + 2
        watcher = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "watch", "--port", str(srv.port), "--record",
             str(args.out), "--duration", str(duration), "--models-every", "1"], cwd=ROOT)
        time.sleep(PHASES_S["ok"] - 2)
        # Running before the squeeze: admissions pause at soft, so a request sent later
        # would only wait in the queue; this one is in flight when hard arrives.
        long_generation(srv.address, default)
        time.sleep(2)
        squeeze(cg, srv, SOFT_RATIO)
        time.sleep(PHASES_S["soft"])
        squeeze(cg, srv, HARD_RATIO)
        time.sleep(PHASES_S["hard"])
        cg.set_limit(LIMIT_BYTES)
        print("[episode] released", flush=True)
        watcher.wait(duration + 30)
        print(f"[episode] {cg.describe()}", flush=True)
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.send_signal(signal.SIGINT)
            watcher.wait(10)
        if srv is not None:
            srv.stop(signal.SIGTERM, 30)
        cg.destroy()
    from service import plot  # noqa: PLC0415

    drawn = plot.draw(plot.load_episode(args.out), args.png, 1200, 600,
                      "plimsoll: a cgroup squeeze (medium demo model), ok → soft → hard → ok")
    print(f"[episode] {drawn}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
