"""Generate the Python gRPC stubs from proto/ (`make proto`; a test checks they are current).

The stubs land in kvserve/v1/ so that the generated imports (`from kvserve.v1 import ...`)
resolve; the top-level name `proto` belongs to proto-plus (a dependency of ray[serve]).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTOS = ["kvserve/v1/generation.proto"]


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc for every .proto into `out_dir`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    suffixes = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    return [out_dir / proto.replace(".proto", suffix) for proto in PROTOS for suffix in suffixes]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT), file=sys.stderr)
