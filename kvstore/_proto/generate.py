"""Regenerate ``kvstore/_proto`` from ``proto/kvstore/v1/kvstore.proto`` (``make proto``).

The generated modules are committed; ``tests/unit/test_proto_fresh.py`` regenerates into a
temporary directory and fails when the committed copies differ.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto" / "kvstore" / "v1"
OUT_DIR = Path(__file__).resolve().parent
FILES = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    """Run protoc into ``out`` and return the generated files' text (imports made relative)."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(PROTO_DIR / "kvstore.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    texts = {}
    for name in FILES:
        text = (out / name).read_text()
        # protoc writes a top-level import; the modules live in the kvstore._proto package.
        text = re.sub(r"^import kvstore_pb2 as", "from . import kvstore_pb2 as", text, flags=re.M)
        texts[name] = text
    return texts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (OUT_DIR / name).write_text(text)
    print(f"regenerated {', '.join(FILES)} in {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
