"""The ``kvstore`` command line: one sub-command per module that registers itself."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError


def size_arg(flag: str):
    """An argparse ``type`` for sizes such as ``512MiB``, with our message on bad input."""
    from kvstore.config import parse_size

    def parse(value: str) -> int:
        try:
            return parse_size(value, flag)
        except KVStoreError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    parse.__name__ = "size"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Multi-tier KV-cache store")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvstore import cli_capacity, cli_bench, cli_demo, cli_serve

    cli_capacity.register(sub)
    cli_bench.register(sub)
    cli_demo.register(sub)
    cli_serve.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVStoreError as err:
        print(f"kvstore {args.command}: error: {err}", file=sys.stderr)
        return 2
