"""Regenerate the checked-in Python code of the kvstore gRPC API from `proto/`.

    python scripts/gen_proto.py            # rewrite kvstore/v1/kvstore_pb2*.py{,i}
    python scripts/gen_proto.py --out DIR  # write into DIR instead (the staleness test uses this)

Runs grpcio-tools' bundled protoc with `-Iproto`, so `kvstore/v1/kvstore.proto` becomes the Python
module `kvstore.v1.kvstore_pb2` inside this package. The generated files are checked in so that an
install needs no code generation; `tests/test_proto.py` fails when they are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ("kvstore/v1/kvstore.proto",)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto into `out_dir`; return the files written."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # a test/dev dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_ROOT / proto),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")
    written = []
    for proto in PROTOS:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_dir / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for p in generate(args.out):
        print(p.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
