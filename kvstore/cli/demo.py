"""``kvstore demo``: the store-level main job (see ``kvstore.cli.demo_run``)."""

from __future__ import annotations

import argparse

from kvstore.cli.args import size_arg


def register(sub) -> None:
    p = sub.add_parser("demo", help="play a shared-prefix workload, restart, read back from SSD")
    p.add_argument("--dir", help="SSD directory to use (default: a temporary one)")
    p.add_argument("--host-capacity", type=size_arg("--host-capacity"), default="256MiB")
    p.add_argument("--ssd-capacity", type=size_arg("--ssd-capacity"), default="4GiB")
    p.add_argument("--phase", choices=["all", "replay"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--report-json", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kvstore.cli import demo_run as demo

    return demo.run(args)
