"""The ``kvstore`` command line: one sub-command per module that registers itself."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Multi-tier KV-cache store")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvstore.cli import bench, capacity, demo, keys, redis_acl, redis_sweep, serve, tokens

    capacity.register(sub)
    bench.register(sub)
    demo.register(sub)
    serve.register(sub)
    tokens.register(sub)
    redis_acl.register(sub)
    redis_sweep.register(sub)
    keys.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVStoreError as err:
        print(f"kvstore {args.command}: error: {err}", file=sys.stderr)
        return 2
