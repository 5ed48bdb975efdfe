"""Argument types shared by the sub-commands."""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.errors import KVStoreError

TOKEN_ENV = "KVSTORE_TOKEN"


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


def add_token_args(parser: argparse.ArgumentParser) -> None:
    """``--token-file`` (preferred), ``--token``, and ``$KVSTORE_TOKEN`` (see ``token_of``)."""
    parser.add_argument("--token-file", help=f"a file whose first line is the bearer token (or set ${TOKEN_ENV})")
    parser.add_argument(
        "--token",
        help="the bearer token itself (other users see it in the process "
        "list: prefer --token-file or $" + TOKEN_ENV + ")",
    )


def token_of(args: argparse.Namespace) -> str | None:
    """The bearer token: ``--token-file``, else ``--token`` (with a warning), else
    ``$KVSTORE_TOKEN``, else this user's default token file (``kvstore.localtoken``);
    None without any."""
    from kvstore.config import read_token_file
    from kvstore.localtoken import local_token

    if getattr(args, "token_file", None):
        return read_token_file(args.token_file)
    if getattr(args, "token", None):
        print(f"warning: --token puts the token in the process list; use --token-file or ${TOKEN_ENV}", file=sys.stderr)
        return args.token
    return os.environ.get(TOKEN_ENV) or local_token()
