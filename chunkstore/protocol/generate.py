"""Generate the Python stubs of proto/chunkstore.proto into this package.

    python -m chunkstore.protocol.generate           # write them
    python -m chunkstore.protocol.generate --check   # exit 1 if the committed ones are stale

grpc_tools emits ``import chunkstore_pb2``, a top-level import; it is rewritten to the
package path so the stubs work installed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent.parent / "proto" / "chunkstore.proto"
OUTPUTS = ("chunkstore_pb2.py", "chunkstore_pb2.pyi", "chunkstore_pb2_grpc.py")


def generate(out_dir: Path, proto: Path = PROTO) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{proto.parent}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    grpc_file = out_dir / "chunkstore_pb2_grpc.py"
    text = grpc_file.read_text().replace(
        "import chunkstore_pb2 as chunkstore__pb2",
        "from chunkstore.protocol import chunkstore_pb2 as chunkstore__pb2",
    )
    grpc_file.write_text(text)


def stale_outputs() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in OUTPUTS
            if not (HERE / name).exists()
            or (HERE / name).read_text() != (Path(tmp) / name).read_text()
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_outputs()
        if stale:
            print(f"stale: {', '.join(stale)}; run make proto", file=sys.stderr)
            return 1
        return 0
    generate(HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
