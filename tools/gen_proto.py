"""Regenerate the Python stubs for proto/plimsoll/v1 (the one command).

    python -m tools.gen_proto            # write stubs beside the .proto files
    python -m tools.gen_proto --out DIR  # write them elsewhere (the staleness test)
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "plimsoll" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
