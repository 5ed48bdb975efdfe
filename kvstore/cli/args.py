"""Argument types shared by the sub-commands."""
from __future__ import annotations

import argparse

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
