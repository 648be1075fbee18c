"""Generate the Python gRPC code from the .proto files in this folder.

Run from anywhere: `python -m proto.build`. Output lands next to the .proto files and is
imported as `proto.pdserve_pb2` / `proto.pdserve_pb2_grpc`.
"""

from __future__ import annotations

import sys
from pathlib import Path


def build() -> None:
    from grpc_tools import protoc
    import grpc_tools

    here = Path(__file__).resolve().parent
    root = here.parent
    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted(here.glob("*.proto")):
        rel = proto.relative_to(root)
        rc = protoc.main(["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
                          f"--pyi_out={root}", f"--grpc_python_out={root}", str(rel)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")


if __name__ == "__main__":
    build()
    sys.exit(0)
