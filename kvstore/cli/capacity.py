"""``kvstore capacity``: KV bytes per token, per request and in total for a model geometry.

A thin command over ``kvstore.layout``: it turns flags into a ``KVGeometry``, calls
``plan_capacity`` and prints the report (text, or one JSON object with ``--json``).  Bad values
raise ``ConfigError``; ``kvstore.cli.main.main`` prints them and exits 2.
"""

from __future__ import annotations

import argparse
import json

from kvstore.errors import ConfigError
from kvstore.layout import DType, KVGeometry
from kvstore.layout.capacity import plan_capacity


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "capacity",
        help="compute KV-cache bytes per token / request / total",
        description="KV bytes = 2 x layers x kv_heads x head_dim x bytes_per_element per token "
        "(MLA: layers x (latent + rope) x bytes), with sliding window, TP and PP.",
    )
    p.add_argument("--layers", type=int, required=True, help="number of attention layers")
    p.add_argument("--kv-heads", type=int, help="KV heads (not Q heads); omit with MLA")
    p.add_argument("--head-dim", type=int, help="head dimension; omit with MLA")
    p.add_argument("--q-heads", type=int, help="query heads, only to label MHA vs GQA")
    p.add_argument("--dtype", type=str, required=True, help="fp32, bf16, fp16 or fp8")
    p.add_argument("--mla-latent-dim", type=int, help="MLA kv_lora_rank (latent dim)")
    p.add_argument("--mla-rope-dim", type=int, help="MLA qk_rope_head_dim (default 0)")
    p.add_argument("--sliding-window", type=int, help="tokens kept by sliding-window layers")
    p.add_argument("--sliding-layers", type=int, help="how many layers use the window (default: all)")
    p.add_argument(
        "--recurrent-layers", type=int, default=0, help="hybrid models: Mamba / linear-attention layers beside --layers"
    )
    p.add_argument(
        "--state-bytes", type=int, default=0, help="the fixed state one recurrent layer keeps per request, in bytes"
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens per request (default 8192)")
    p.add_argument("--requests", type=int, default=1, help="unshared requests (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--chunk-size", type=int, help="tokens per stored chunk; multiple of block size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _geometry(args: argparse.Namespace) -> KVGeometry:
    dtype = DType.parse(args.dtype)
    extra = {
        "q_heads": args.q_heads,
        "sliding_window": args.sliding_window,
        "sliding_layers": args.sliding_layers,
        "tp": args.tp,
        "pp": args.pp,
        "recurrent_layers": args.recurrent_layers,
        "state_bytes": args.state_bytes,
    }
    if args.mla_latent_dim is None:
        if args.mla_rope_dim is not None:
            raise ConfigError("--mla-rope-dim needs --mla-latent-dim")
        if args.kv_heads is None or args.head_dim is None:
            raise ConfigError("--kv-heads and --head-dim are required (or give --mla-latent-dim)")
        return KVGeometry(args.layers, args.kv_heads, args.head_dim, dtype, **extra)
    if args.kv_heads is not None or args.head_dim is not None:
        raise ConfigError(
            "--kv-heads/--head-dim do not apply with --mla-latent-dim: MLA caches one latent+rope vector per layer"
        )
    return KVGeometry.mla(args.layers, args.mla_latent_dim, args.mla_rope_dim or 0, dtype, **extra)


def run(args: argparse.Namespace) -> int:
    report = plan_capacity(
        _geometry(args),
        tokens=args.tokens,
        requests=args.requests,
        block_size=args.block_size,
        chunk_size=args.chunk_size,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0
