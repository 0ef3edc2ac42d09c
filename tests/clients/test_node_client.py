"""A Node service's view: @grpc/grpc-js with @grpc/proto-loader reading proto/ directly.

The client (tests/clients/node/generate.mjs) has no generated code: it loads
proto/plimsoll/v1/inference.proto at run time, as most Node services do, and
prints every Generate message as one JSON line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
CLIENT = NODE_DIR / "generate.mjs"
NODE = shutil.which("node")
NPM = shutil.which("npm")

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None,
    reason="node and npm are needed for the Node client test (not found on PATH)",
)


@pytest.fixture(scope="session")
def node_client() -> Path:
    """Installs the locked dependencies once per session when node_modules is missing."""
    needed = [
        NODE_DIR / "node_modules" / "@grpc" / p / "package.json"
        for p in ("grpc-js", "proto-loader")
    ] + [NODE_DIR / "node_modules" / "@bufbuild" / "buf" / "package.json"]
    if not all(p.exists() for p in needed):
        result = subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, (
            f"npm ci failed ({result.returncode}); it needs the npm registry\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return CLIENT


def run_client(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NODE, str(CLIENT), "--address", server.address, *args],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_node_generate_streams_start_chunks_end(server, node_client):
    max_tokens = 12
    result = run_client(server, "--text", "hello from node", "--max-tokens", str(max_tokens))
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    messages = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    events = [m["event"] for m in messages]

    assert events[0] == "start"
    start = messages[0]["start"]
    assert start["requestId"]
    assert start["modelId"] == "demo-tiny"
    assert start["promptTokens"] > 0
    assert start["pressureLevel"].startswith("PRESSURE_LEVEL_")

    assert events[-1] == "end"
    assert set(events[1:-1]) == {"chunk"}
    token_ids = [t for m in messages[1:-1] for t in m["chunk"]["tokenIds"]]
    assert len(token_ids) == max_tokens
    assert all(isinstance(t, int) and t >= 0 for t in token_ids)
    assert all(isinstance(m["chunk"]["text"], str) for m in messages[1:-1])

    end = messages[-1]["end"]
    assert end["finishReason"] == "FINISH_REASON_LENGTH"
    assert end["usage"]["completionTokens"] == max_tokens
    assert end["usage"]["promptTokens"] == start["promptTokens"]
    ttft = end["timings"]["timeToFirstToken"]  # a Duration: {seconds, nanos}
    assert int(ttft["seconds"]) * 1e9 + ttft["nanos"] > 0


def test_node_sees_the_status_of_a_failed_stream(server, node_client):
    result = run_client(server, "--model", "no-such-model", "--max-tokens", "4")
    assert result.returncode != 0
    assert result.stdout.strip() == ""
    status = json.loads(result.stderr.strip().splitlines()[-1])
    assert status["codeName"] == "NOT_FOUND"
    assert status["code"] == 5
    assert "no-such-model" in status["details"]


def test_contract_is_buf_standard_clean(node_client):
    """`buf lint` (STANDARD, proto/buf.yaml) from the locked npm package."""
    buf = NODE_DIR / "node_modules" / ".bin" / "buf"
    result = subprocess.run([str(buf), "lint"], cwd=NODE_DIR.parents[2] / "proto",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
