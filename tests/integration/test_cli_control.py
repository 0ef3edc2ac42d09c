"""The operator verbs of `plimsoll` over real gRPC against a real server (the tiny demo
model, a custom 8 GiB ceiling so the figures hold still): the text has the key figures,
--json parses and has the fields, and a failure is one typed line with code and reason."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from engine import blas
from plimsoll.v1 import inference_pb2
from service import cli
from service.cli_common import GiB, fmt_bytes
from tools.harness.server import ROOT, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def plimsoll(srv, capsys):
    """plimsoll(*argv) -> (exit code, stdout, stderr), run in-process against `srv`."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main([*argv, "--port", str(srv.port)])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def as_json(result: tuple[int, str, str]) -> dict:
    rc, out, err = result
    assert rc == 0, err
    assert out.count("\n") == 1, f"one JSON document on one line, got {out!r}"
    return json.loads(out)


def one_error(result: tuple[int, str, str], code: str, reason: str) -> str:
    rc, _, err = result
    assert rc == 1, (rc, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {code} {reason}: "), err
    return err


def test_status_prints_level_marks_ceiling_pool_bank_and_models(plimsoll):
    rc, out, err = plimsoll("status")
    assert rc == 0, err
    ceiling = 8 * GiB
    assert " OK " in out and "tier custom" in out
    assert f"ceiling          {fmt_bytes(ceiling)}  (binding term: custom)" in out
    assert f"soft             {fmt_bytes(int(ceiling * 0.85))}" in out
    assert f"hard             {fmt_bytes(int(ceiling * 0.95))}" in out
    for key in ("usage", "pool", "bank", "reservations", "requests", "admission limit"):
        assert f"\n{key} " in out, key
    assert "demo-tiny (default)" in out and "ready" in out and "4096" in out
    # The server's own BLAS, its description wrapped over lines at the console's width.
    assert f"blas {blas.state().description}" in " ".join(out.split())


def test_status_json_has_every_figure_as_numbers(plimsoll):
    doc = as_json(plimsoll("status", "--json"))
    assert doc["level"] == "ok" and doc["enforcer_enabled"] is True
    lim = doc["limits"]
    assert lim["ceiling_bytes"] == 8 * GiB and lim["binding_term"] == "custom"
    assert lim["soft_bytes"] < lim["hard_bytes"] < lim["ceiling_bytes"]
    assert isinstance(doc["readings"]["process_bytes"], int) and doc["readings"]["process_bytes"]
    assert {"mlx_pool_bytes", "footprint_bytes", "sources"} <= set(doc["readings"])
    assert {"session_bank_bytes", "reservations", "reserved_bytes", "running",
            "paused"} <= set(doc["admission"])
    [model] = [m for m in doc["models"] if m["model_id"] == "demo-tiny"]
    assert model["state"] == "ready" and model["is_default"] and model["measured_bytes"] > 0
    assert isinstance(doc["poll_interval"], float)


def test_admit_gives_the_verdict_and_the_numbers(plimsoll):
    rc, out, err = plimsoll("admit", "Once upon a time", "--max-tokens", "16")
    assert rc == 0, err
    assert "ADMIT" in out
    for key in ("usage", "request", "projected", "admission limit", "headroom"):
        assert f"\n{key} " in out, key
    doc = as_json(plimsoll("admit", "--tokens", "200", "--max-tokens", "32", "--json"))
    assert doc["verdict"] == "admit" and doc["pressure_level"] == "ok"
    assert doc["request_bytes"] > 0 and doc["projected_bytes"] >= doc["usage_bytes"]
    assert doc["admission_limit_bytes"] > doc["projected_bytes"] and doc["ticket"] == ""


def test_admit_reserve_holds_a_ticket_that_status_counts(plimsoll):
    doc = as_json(plimsoll("admit", "a reserved prompt", "--reserve", "--ttl", "20", "--json"))
    assert doc["ticket"] and doc["reservation_ttl"] == 20.0 and doc["ticket_expire_time"]
    status = as_json(plimsoll("status", "--json"))
    assert status["admission"]["reservations"] >= 1
    assert status["admission"]["reserved_bytes"] >= doc["request_bytes"]
    rc, out, _ = plimsoll("admit", "another", "--reserve")
    assert rc == 0 and "\nticket " in out and "\nexpires " in out


def test_generate_redeems_a_reserved_ticket(plimsoll):
    doc = as_json(plimsoll("admit", "a reserved turn", "--max-tokens", "8", "--reserve",
                           "--json"))
    held = as_json(plimsoll("status", "--json"))["admission"]["reservations"]
    rc, out, err = plimsoll("generate", "a reserved turn", "--max-tokens", "8",
                            "--ticket", doc["ticket"])
    assert rc == 0 and "generated tokens" in err, err
    assert as_json(plimsoll("status", "--json"))["admission"]["reservations"] == held - 1
    # Redeemed once: the same ticket again is refused, one typed line.
    rc, _, err = plimsoll("generate", "a reserved turn", "--max-tokens", "8",
                          "--ticket", doc["ticket"])
    assert rc == 1 and err.startswith("error: ") and err.count("\n") == 1, err


def test_admit_with_bad_fields_is_one_typed_line(plimsoll):
    err = one_error(plimsoll("admit", "x", "--temperature", "-1"),
                    "INVALID_ARGUMENT", "INVALID_FIELD")
    assert "request.sampling.temperature" in err
    err = one_error(plimsoll("admit", "--tokens", "5000"), "OUT_OF_RANGE", "FIELD_OUT_OF_RANGE")
    assert "4096" in err
    one_error(plimsoll("admit", ""), "INVALID_ARGUMENT", "INVALID_FIELD")
    rc, out, err = plimsoll("admit", "x", "--temperature", "-1", "--json")
    assert rc == 1 and err.startswith("error: INVALID_ARGUMENT INVALID_FIELD: ")
    doc = json.loads(out)["error"]
    assert doc["code"] == "INVALID_ARGUMENT" and doc["reason"] == "INVALID_FIELD"
    assert [v["field"] for v in doc["field_violations"]] == ["request.sampling.temperature"]
    one_error(plimsoll("admit", "x", "--model", "nope"), "NOT_FOUND", "MODEL_NOT_FOUND")


def test_pin_and_unpin_a_model(plimsoll):
    lease = as_json(plimsoll("pin", "demo-tiny", "--owner", "cli-test", "--json"))["lease"]
    assert lease["model_id"] == "demo-tiny" and lease["owner"] == "cli-test"
    status = as_json(plimsoll("status", "--json"))
    assert any(m["pinned"] for m in status["models"] if m["model_id"] == "demo-tiny")
    assert lease["lease_id"] in {le["lease_id"] for le in status["leases"]}
    rc, out, err = plimsoll("unpin", lease["lease_id"])
    assert rc == 0 and f"released  {lease['lease_id']}" in out, err
    one_error(plimsoll("unpin", lease["lease_id"]), "NOT_FOUND", "LEASE_NOT_FOUND")
    rc, out, _ = plimsoll("pin", "demo-tiny", "--ttl", "30")
    assert rc == 0 and "target   model demo-tiny" in out and "expires  never" not in out


def test_pin_or_unload_of_an_unknown_model_is_one_typed_line(plimsoll):
    err = one_error(plimsoll("pin", "nope"), "NOT_FOUND", "MODEL_NOT_FOUND")
    assert err == "error: NOT_FOUND MODEL_NOT_FOUND: model 'nope' is not known (known: " \
        "demo-tiny)\n"
    one_error(plimsoll("unload", "nope"), "NOT_FOUND", "MODEL_NOT_FOUND")
    rc, _, err = plimsoll("pin")
    assert rc == 2 and err == "error: pin: give a MODEL or --session ID (exactly one)\n"


def test_load_and_unload_a_second_model_with_force(plimsoll, demo_path):
    rc, out, err = plimsoll("load", str(demo_path), "--id", "cli-second")
    assert rc == 0 and "loaded cli-second" in out and "ready" in out, err
    lease = as_json(plimsoll("pin", "cli-second", "--json"))["lease"]
    err = one_error(plimsoll("unload", "cli-second"), "FAILED_PRECONDITION", "MODEL_PINNED")
    assert "force" in err
    doc = as_json(plimsoll("unload", "cli-second", "--force", "--json"))
    assert doc["released_leases"] == 1 and doc["freed_bytes"] >= 0
    one_error(plimsoll("unpin", lease["lease_id"]), "NOT_FOUND", "LEASE_NOT_FOUND")
    models = {m["model_id"]: m for m in as_json(plimsoll("status", "--json"))["models"]}
    assert models["cli-second"]["state"] == "unloaded" and models["demo-tiny"]["state"] == "ready"
    one_error(plimsoll("unload", "cli-second"), "FAILED_PRECONDITION", "MODEL_NOT_LOADED")
    doc = as_json(plimsoll("load", str(demo_path), "--id", "cli-second", "--json"))
    assert doc["model"]["state"] == "ready" and doc["model"]["measured_bytes"] > 0
    rc, out, _ = plimsoll("unload", "cli-second")
    assert rc == 0 and "unloaded" in out and "released leases   0" in out


def test_sessions_list_and_drop(plimsoll, stubs):
    _, inference = stubs
    req = inference_pb2.GenerateRequest(text="a session to list", max_tokens=4,
                                        session_id="cli-s1")
    list(inference.Generate(req, timeout=60))
    deadline = time.monotonic() + 10
    while True:  # the bank stores the snapshot just after the stream ends
        doc = as_json(plimsoll("sessions", "--json"))
        if any(s["session_id"] == "cli-s1" for s in doc["sessions"]) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    [s1] = [s for s in doc["sessions"] if s["session_id"] == "cli-s1"]
    assert s1["bytes"] > 0 and s1["entries"][0]["model_id"] == "demo-tiny"
    assert doc["total_bytes"] >= s1["bytes"]
    rc, out, _ = plimsoll("sessions")
    assert rc == 0 and "cli-s1" in out and "demo-tiny" in out and "in the bank" in out
    rc, out, _ = plimsoll("sessions", "drop", "cli-s1")
    assert rc == 0 and "dropped  cli-s1" in out and "freed" in out
    one_error(plimsoll("sessions", "drop", "cli-s1"), "NOT_FOUND", "SESSION_NOT_FOUND")
    rc, _, err = plimsoll("sessions", "drop")
    assert rc == 2 and err == "error: sessions drop: give the session ID\n"


def test_no_server_is_one_line_too(capsys):
    port = free_port()
    assert cli.main(["status", "--port", str(port)]) == 1
    assert capsys.readouterr().err == \
        f"error: UNAVAILABLE: cannot reach a server at 127.0.0.1:{port}\n"


def test_the_installed_command_exits_non_zero_without_a_traceback(srv):
    """Through the real entry point, as a script would call it."""
    proc = subprocess.run([sys.executable, "-m", "service.cli", "unload", "nope", "--port",
                           str(srv.port)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    # The known ids depend on what the tests before loaded: one line all the same.
    assert re.fullmatch(r"error: NOT_FOUND MODEL_NOT_FOUND: model 'nope' is not known "
                        r"\(known: [a-z0-9, -]*demo-tiny[a-z0-9, -]*\)\n", proc.stderr), \
        proc.stderr
    proc = subprocess.run([sys.executable, "-m", "service.cli", "status", "--json", "--port",
                           str(srv.port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["level"] == "ok"


def test_client_verbs_do_not_load_the_server_s_modules():
    """MLX and mlx-lm load with `serve` only: a client verb starts in a fraction of the
    second an interpreter needs to import them."""
    code = ("import sys, service.cli; heavy = {'mlx_lm', 'mlx.core', 'transformers'}; "
            "print(sorted(heavy & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_older_verbs_still_work(plimsoll):
    rc, out, _ = plimsoll("models")
    assert rc == 0 and "demo-tiny*" in out
    rc, out, _ = plimsoll("health")
    assert rc == 0 and out.strip() == "SERVING"
