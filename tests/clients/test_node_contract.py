"""The contract as a polyglot client sees it: a Node client (tests/clients/node/contract.mjs).

The client loads proto/plimsoll/v1/{inference,control}.proto with @grpc/proto-loader at
run time (no generated code) and decodes the rich error model (google.rpc.Status in the
grpc-status-details-bin trailer) with protobufjs from the googleapis-common-protos
.proto files in this venv. Each command prints what Node saw as JSON; the assertions
are here, so a failure shows the JSON that disagreed.

  1. reservations: Admit{reserve} does not compound, GetMemoryStatus.admission counts
     the tickets, a long TTL is clamped, other clients still get in, a redeemed or
     mismatched ticket is released;
  2. Admit predicts Generate: ADMIT then a start; at the in-flight limit WAIT /
     IN_FLIGHT_LIMIT then RESOURCE_EXHAUSTED / IN_FLIGHT_LIMIT;
  4. the error table: NOT_FOUND + ResourceInfo, BadRequest field paths (prefixed
     "request." for Admit), MODEL_NOT_LOADED, domain "plimsoll.dev" everywhere;
  5. drain (SIGTERM): health NOT_SERVING, new work UNAVAILABLE / DRAINING with
     RetryInfo, running streams cut after the grace with an ABORTED end and then
     UNAVAILABLE / DRAINING, and a clean exit.
"""

from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from google.rpc import status_pb2

from tools.harness.server import serving, start_server

NODE_DIR = Path(__file__).resolve().parent / "node"
CONTRACT = NODE_DIR / "contract.mjs"
# The folder holding google/rpc/status.proto and error_details.proto.
RPC_PROTOS = Path(status_pb2.__file__).resolve().parents[2]
NODE = shutil.which("node")
NPM = shutil.which("npm")
DOMAIN = "plimsoll.dev"
GRACE_S = 2.0

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None,
    reason="node and npm are needed for the Node contract tests (not found on PATH)",
)


@pytest.fixture(scope="session")
def node_contract() -> Path:
    """Installs the locked dependencies once when node_modules lacks them."""
    needed = [NODE_DIR / "node_modules" / p / "package.json"
              for p in ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs")]
    if not all(p.exists() for p in needed):
        result = subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (
            f"npm ci failed ({result.returncode}); it needs the npm registry\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    for name in ("status.proto", "error_details.proto"):
        assert (RPC_PROTOS / "google" / "rpc" / name).is_file(), f"no google/rpc/{name}"
    return CONTRACT


def contract_cmd(address: str, command: str, *args: str) -> list[str]:
    return [NODE, str(CONTRACT), command, "--address", address,
            "--rpc-protos", str(RPC_PROTOS), *args]


def run_contract(address: str, command: str, *args: str, timeout: float = 120) -> list[dict]:
    """Runs one contract.mjs command to its end; its JSON lines."""
    result = subprocess.run(contract_cmd(address, command, *args), cwd=NODE_DIR,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"contract.mjs {command} exited {result.returncode}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def show(value) -> str:
    return json.dumps(value, indent=1)


def check_status(status: dict | None, code: str, reason: str, *, retry: bool | None = None,
                 resource: tuple[str, str] | None = None) -> None:
    """A rich status as Node decoded it: the code, ErrorInfo (domain and reason) first,
    RetryInfo when `retry` (absent when False), ResourceInfo when `resource`."""
    assert status is not None, "no status"
    assert status["codeName"] == code, show(status)
    assert status["hasDetailsBin"], f"no grpc-status-details-bin trailer: {show(status)}"
    assert status["statusCode"] == status["code"], show(status)
    assert status["detailTypes"][:1] == ["google.rpc.ErrorInfo"], show(status)
    info = status["details"]["ErrorInfo"]
    assert info["domain"] == DOMAIN, show(status)
    assert info["reason"] == reason, show(status)
    if retry is not None:
        assert ("RetryInfo" in status["details"]) == retry, show(status)
        if retry:
            delay = status["details"]["RetryInfo"]["retryDelay"]
            assert int(delay["seconds"]) * 10**9 + delay["nanos"] > 0, show(status)
    if resource is not None:
        got = status["details"].get("ResourceInfo")
        assert got is not None, f"no ResourceInfo: {show(status)}"
        assert (got["resourceType"], got["resourceName"]) == resource, show(status)


def seconds(duration: dict | None) -> float:
    assert duration is not None, "no Duration"
    return int(duration["seconds"]) + duration["nanos"] / 1e9


# ------------------------------------------------------------------ 1. reservations
@pytest.fixture(scope="module")
def reservations(server, node_contract) -> dict:
    (out,) = run_contract(server.address, "reservations")
    return out


def test_eight_reservations_do_not_compound(reservations):
    r = reservations
    assert r["baseline"]["reservations"] == 0 and int(r["baseline"]["reservedBytes"]) == 0, \
        show(r["baseline"])
    admits = r["admits"]
    assert all(a["ok"] for a in admits), show(admits)
    responses = [a["response"] for a in admits]
    assert {x["verdict"] for x in responses} == {"ADMIT_VERDICT_ADMIT"}, show(responses)
    assert len({x["ticket"] for x in responses}) == 8 and all(x["ticket"] for x in responses)
    request_bytes = {int(x["requestBytes"]) for x in responses}
    assert len(request_bytes) == 1, f"request_bytes compounds over the Admits: {request_bytes}"
    (each,) = request_bytes
    assert each > 0
    # Each Admit counts the tickets taken before it, and projects usage + its own + those.
    assert [int(x["reservedBytes"]) for x in responses] == [k * each for k in range(8)]
    for x in responses:
        assert int(x["projectedBytes"]) == (int(x["usageBytes"]) + int(x["requestBytes"])
                                            + int(x["reservedBytes"])), show(x)
        assert seconds(x["reservationTtl"]) == pytest.approx(30), show(x)  # the default
    after = r["afterEight"]
    assert after["reservations"] == 8, show(after)
    assert int(after["reservedBytes"]) == 8 * each, show(after)


def test_a_ten_year_ttl_is_clamped_to_the_server_maximum(reservations):
    clamped = reservations["clamped"]
    assert clamped["ok"], show(clamped)
    resp = clamped["response"]
    assert resp["verdict"] == "ADMIT_VERDICT_ADMIT" and resp["ticket"], show(resp)
    assert seconds(resp["reservationTtl"]) == pytest.approx(300), show(resp)
    assert "clamped" in resp["reason"], show(resp)
    expires_ms = seconds(resp["ticketExpireTime"]) * 1000
    assert expires_ms - reservations["clampedAskedAt"] == pytest.approx(300_000, abs=5_000)
    assert reservations["afterClamped"]["reservations"] == 9, show(reservations["afterClamped"])


def test_a_retry_with_the_same_client_request_id_gets_the_same_ticket(reservations):
    first, retry = reservations["idempotent"]
    assert first["ok"] and retry["ok"], show(reservations["idempotent"])
    assert first["response"]["ticket"] and \
        retry["response"]["ticket"] == first["response"]["ticket"], show(reservations["idempotent"])
    assert reservations["afterIdempotent"]["reservations"] == 10, \
        show(reservations["afterIdempotent"])


def test_a_retried_admit_does_not_count_its_own_ticket_as_another_clients(reservations):
    """reserved_bytes is *other clients'* reservations, and projected_bytes adds the
    request's own bytes once: the retry (same client_request_id, same ticket) must
    not count its own reservation among the others."""
    first, retry = (a["response"] for a in reservations["idempotent"])
    assert int(retry["reservedBytes"]) == int(first["reservedBytes"]), (
        f"the retry reports reserved_bytes {retry['reservedBytes']}, the first Admit "
        f"{first['reservedBytes']} (request_bytes {first['requestBytes']}): its own "
        f"ticket is counted as another client's")


def test_another_clients_generate_is_still_admitted(reservations):
    other = reservations["otherClient"]
    assert other["firstEvent"] == "start" and other["lastEvent"] == "end", show(other)
    assert other["status"]["codeName"] == "OK", show(other)
    assert other["end"]["finishReason"] == "FINISH_REASON_LENGTH", show(other)


def test_a_redeemed_ticket_is_released(reservations):
    redeemed = reservations["redeemed"]
    assert redeemed["status"]["codeName"] == "OK", show(redeemed)
    assert redeemed["lastEvent"] == "end", show(redeemed)
    before, after = reservations["afterOtherClient"], reservations["afterRedeem"]
    assert after["reservations"] == before["reservations"] - 1, show([before, after])
    each = int(reservations["admits"][0]["response"]["requestBytes"])
    assert int(after["reservedBytes"]) == int(before["reservedBytes"]) - each


def test_a_ticket_with_another_prompt_is_a_mismatch_and_is_released(reservations):
    mismatch = reservations["mismatch"]
    assert mismatch["messageCount"] == 0, show(mismatch)
    check_status(mismatch["status"], "FAILED_PRECONDITION", "TICKET_MISMATCH", retry=False)
    before, after = reservations["afterRedeem"], reservations["afterMismatch"]
    assert after["reservations"] == before["reservations"] - 1, show([before, after])
    # Released: not even its own request can redeem it now.
    reuse = reservations["reuseAfterMismatch"]
    ticket = reservations["admits"][1]["response"]["ticket"]
    check_status(reuse["status"], "NOT_FOUND", "TICKET_NOT_FOUND", resource=("ticket", ticket))


def test_every_remaining_ticket_redeems_and_nothing_is_left_held(reservations):
    for c in reservations["cleanup"]:
        assert c["status"]["codeName"] == "OK" and c["lastEvent"] == "end", show(c)
    after = reservations["afterCleanup"]
    assert after["reservations"] == 0 and int(after["reservedBytes"]) == 0, show(after)


# ------------------------------------------------------------------ 2. Admit vs Generate
def test_admit_says_admit_and_generate_starts(server, node_contract):
    (out,) = run_contract(server.address, "admit-generate")
    assert out["admit"]["ok"], show(out)
    admit = out["admit"]["response"]
    assert admit["verdict"] == "ADMIT_VERDICT_ADMIT", show(admit)
    assert admit["bindingConstraint"] == "ADMIT_CONSTRAINT_UNSPECIFIED", show(admit)
    assert admit["errorReason"] == "" and admit["ticket"] == "", show(admit)
    assert out["generate"]["kind"] == "start", show(out["generate"])


def test_at_the_in_flight_limit_admit_says_wait_and_generate_is_refused(tmp_path,
                                                                        node_contract):
    with serving(tmp_path, "--max-queued-requests", "1") as srv:
        (out,) = run_contract(srv.address, "admit-generate", "--hold")
    assert out["holdRunning"] and out["holdStillRunning"], show(out)
    assert out["admissionWhileHeld"]["running"] == 1, show(out["admissionWhileHeld"])
    assert out["admit"]["ok"], show(out["admit"])
    admit = out["admit"]["response"]
    assert admit["verdict"] == "ADMIT_VERDICT_WAIT", show(admit)
    assert admit["bindingConstraint"] == "ADMIT_CONSTRAINT_IN_FLIGHT_LIMIT", show(admit)
    assert admit["errorReason"] == "IN_FLIGHT_LIMIT", show(admit)
    assert seconds(admit["retryAfter"]) > 0, show(admit)
    assert out["generate"]["kind"] == "status", show(out["generate"])
    check_status(out["generate"]["status"], "RESOURCE_EXHAUSTED", admit["errorReason"],
                 retry=True)
    # Once the long stream is gone, both agree on ADMIT again.
    assert out["admitAfterRelease"]["ok"], show(out["admitAfterRelease"])
    assert out["admitAfterRelease"]["response"]["verdict"] == "ADMIT_VERDICT_ADMIT"
    assert out["generateAfterRelease"]["kind"] == "start", show(out["generateAfterRelease"])


# ------------------------------------------------------------------ 4. the error table
@pytest.fixture(scope="module")
def error_table(server, node_contract, demo_path) -> dict:
    lines = run_contract(server.address, "errors", "--model-source", str(demo_path))
    return {(line["case"], line.get("rpc", "")): line for line in lines}


BOTH = ("Generate", "Admit")


def prefix(rpc: str) -> str:
    return "request." if rpc == "Admit" else ""


@pytest.mark.parametrize("rpc", BOTH)
def test_unknown_model_is_not_found_with_resource_info(error_table, rpc):
    line = error_table["unknown-model", rpc]
    check_status(line["status"], "NOT_FOUND", "MODEL_NOT_FOUND", retry=False,
                 resource=("model", "no-such-model-from-node"))


@pytest.mark.parametrize("rpc", BOTH)
def test_two_bad_fields_are_both_listed_by_path(error_table, rpc):
    status = error_table["two-bad-fields", rpc]["status"]
    # One malformed field makes it INVALID_ARGUMENT; each violation keeps its own reason.
    check_status(status, "INVALID_ARGUMENT", "INVALID_FIELD", retry=False)
    bad = status["details"].get("BadRequest")
    assert bad is not None, f"no BadRequest: {show(status)}"
    got = {v["field"]: v["reason"] for v in bad["fieldViolations"]}
    p = prefix(rpc)
    assert got == {f"{p}sampling.temperature": "INVALID_FIELD",
                   f"{p}max_tokens": "FIELD_OUT_OF_RANGE"}, show(status)
    for v in bad["fieldViolations"]:
        assert v["description"].startswith(v["field"]), show(v)


@pytest.mark.parametrize("rpc", BOTH)
def test_max_tokens_beyond_context_alone_is_out_of_range(error_table, rpc):
    status = error_table["max-tokens-beyond-context", rpc]["status"]
    check_status(status, "OUT_OF_RANGE", "FIELD_OUT_OF_RANGE", retry=False)
    bad = status["details"].get("BadRequest")
    assert bad is not None, f"no BadRequest: {show(status)}"
    assert [v["field"] for v in bad["fieldViolations"]] == [f"{prefix(rpc)}max_tokens"]


@pytest.mark.parametrize("rpc", BOTH)
def test_a_known_unloaded_model_is_not_loaded(error_table, rpc):
    prep = error_table["spare-load-unload", ""]
    assert prep["load"] == "MODEL_STATE_READY" and prep["unload"] == "ok", show(prep)
    check_status(error_table["unloaded-model", rpc]["status"], "FAILED_PRECONDITION",
                 "MODEL_NOT_LOADED", retry=False, resource=("model", "node-contract-spare"))


def test_no_error_started_a_stream(error_table):
    for (case, rpc), line in error_table.items():
        if rpc == "Generate":
            assert line["messages"] == 0, f"{case}: {show(line)}"


# ------------------------------------------------------------------ 5. drain
def read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"contract.mjs printed nothing in {timeout}s")
    return proc.stdout.readline()


def test_sigterm_drain_as_node_sees_it(tmp_path, node_contract):
    srv = start_server(tmp_path, "--drain-seconds", str(GRACE_S))
    node = subprocess.Popen(contract_cmd(srv.address, "drain"), cwd=NODE_DIR,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(node, 60)
        assert line.strip(), f"contract.mjs ended early: {node.communicate(timeout=10)}"
        streaming = json.loads(line)
        assert streaming["event"] == "streaming" and not any(streaming["ended"]), streaming
        signalled_ms = time.time() * 1000
        srv.proc.send_signal(signal.SIGTERM)
        rest, errors = node.communicate(timeout=60)
        rc = srv.proc.wait(60)
    finally:
        if node.poll() is None:
            node.kill()
        srv.stop(signal.SIGKILL)
    assert node.returncode == 0, f"contract.mjs drain exited {node.returncode}:\n{errors}"
    (out,) = [json.loads(x) for x in rest.splitlines() if x.strip()]
    log = srv.log()

    # Probes: NOT_SERVING for every service, through a listener that stays open.
    assert out["notServingAt"] is not None, show(out["healthPolls"])
    assert out["notServingAt"] - signalled_ms < GRACE_S * 1000, show(out)
    assert set(out["healthPolls"]) <= {"SERVING", "NOT_SERVING"}, show(out["healthPolls"])
    assert set(out["health"].values()) == {"NOT_SERVING"}, show(out["health"])
    assert out["healthList"] == dict.fromkeys(out["health"], "NOT_SERVING"), \
        show(out["healthList"])
    assert out["memoryStatus"].get("draining") is True, show(out["memoryStatus"])

    # New work is refused, with RetryInfo (another replica may take it).
    late = out["lateGenerate"]
    assert late["messageCount"] == 0, show(late)
    check_status(late["status"], "UNAVAILABLE", "DRAINING", retry=True)
    assert not out["lateAdmit"]["ok"], show(out["lateAdmit"])
    check_status(out["lateAdmit"]["status"], "UNAVAILABLE", "DRAINING", retry=True)
    assert out["checksDoneAt"] - signalled_ms < GRACE_S * 1000, "the checks outlasted the grace"
    assert all(out["streamsRunningAfterChecks"]), "a stream ended before the grace did"

    # The running streams go on through the grace, then are cut: an ABORTED end with
    # the usage so far, then UNAVAILABLE / DRAINING.
    for s in out["streams"]:
        assert s["firstEvent"] == "start", show(s)
        assert s["tokensReceived"] > s["tokensBeforeSignal"], f"did not run on: {show(s)}"
        assert s["endedAt"] - signalled_ms >= GRACE_S * 1000 - 100, f"cut early: {show(s)}"
        assert s["lastEvent"] == "end" and s["endCount"] == 1, \
            f"the cut stream has no GenerateEnd last: {show(s)}"
        end = s["end"]
        assert end["finishReason"] == "FINISH_REASON_ABORTED", show(s)
        assert end["usage"]["completionTokens"] == s["tokensReceived"], show(s)
        assert end["usage"]["promptTokens"] == s["start"]["promptTokens"], show(s)
        check_status(s["status"], "UNAVAILABLE", "DRAINING", retry=True)

    assert rc == 0, f"server exited {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
