"""Regenerate (or check) the committed protobuf code from ``protocol.proto``.

``python -m tidings.protocol.generate`` rewrites ``protocol_pb2*.py[i]`` next to the .proto;
``--check`` generates into a temporary folder and exits 1 if the committed files differ.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent  # the folder holding the `tidings` package
PROTOS = ["tidings/protocol/protocol.proto"]
OUTPUTS = ["protocol_pb2.py", "protocol_pb2.pyi", "protocol_pb2_grpc.py"]
# The grpcio the generated stub demands at import (its GRPC_GENERATED_VERSION): pyproject's floor, whatever
# grpcio-tools generated it (a newer one would stamp its own version and refuse every older grpcio).
GRPC_FLOOR = "1.85.1"


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) with `out_dir` as the output root."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency (regenerating only), untyped

    args = [
        "protoc",
        f"-I{SRC}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {PROTOS}")
    stub = out_dir / "tidings" / "protocol" / "protocol_pb2_grpc.py"
    stub.write_text(re.sub(r"^GRPC_GENERATED_VERSION = .*$", f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'",
                           stub.read_text(), count=1, flags=re.M))  # fmt: skip


# The generators' own versions, stamped into their output: a newer grpcio-tools (what a fresh install
# gets) must not make current code look stale.
_STAMPS = re.compile(r"^# Protobuf Python Version: .*$|ValidateProtobufRuntimeVersion\([^)]*\)", re.M)


def _unstamped(path: Path) -> str:
    return _STAMPS.sub("", path.read_text())


def stale_files() -> list[str]:
    """Names of committed generated files that differ from a fresh generation (versions aside)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "tidings" / "protocol"
        return [
            name
            for name in OUTPUTS
            if not (HERE / name).exists() or _unstamped(fresh / name) != _unstamped(HERE / name)
        ]


def main() -> None:
    if "--check" in sys.argv:
        stale = stale_files()
        if stale:
            print(f"generated protobuf code is stale: {stale}; run `make proto`", file=sys.stderr)
            raise SystemExit(1)
        return
    generate(SRC)


if __name__ == "__main__":
    main()
