"""``kvstore bench <suite>``: benchmarks beside limits measured in the same run."""
from __future__ import annotations


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each figure beside its same-run limit")
    suites = bench.add_subparsers(dest="suite", required=True)
    tiers = suites.add_parser("tiers", help="host DRAM and SSD tiers, hashing and lookup")
    tiers.add_argument("--dir", help="directory for SSD files (default: system temp dir)")
    tiers.add_argument("--json", help="write the rows as JSON to this file")
    tiers.add_argument("--repeat", type=int, default=7, help="repetitions per figure (median)")
    tiers.set_defaults(func=_tiers)
    _register_e2e(suites)
    _register_store(suites)
    _register_redis(suites)


def _register_e2e(suites) -> None:
    from connector.tinymodel import GEOMETRIES  # no torch/vLLM import at parse time

    e2e = suites.add_parser("e2e", help="TTFT on a real vLLM engine: ours, ExampleConnector, LMCache")
    e2e.add_argument("--json", help="write rows and per-setup results as JSON to this file")
    e2e.add_argument("--geometry", default="bench", choices=sorted(GEOMETRIES), help="model shape")
    e2e.add_argument("--model-dir", help="where the model is built (default ~/.cache/kvstore/models/GEOMETRY)")
    e2e.add_argument("--repeats", type=_positive, default=1, help="whole comparisons; samples pooled")
    e2e.add_argument("--prompts", type=_positive, default=8, help="distinct long prompts")
    e2e.add_argument("--prompt-len", type=_positive, default=2080, help="tokens per long prompt")
    e2e.add_argument("--shorts", type=int, default=3, help="short unrelated prompts in between")
    e2e.add_argument("--max-tokens", type=_positive, default=8, help="generated tokens per request")
    e2e.add_argument("--skip-lmcache", action="store_true", help="leave out the LMCache setup")
    e2e.add_argument("--single-process", action="store_true",
                     help="engines in single-process mode: faster start, no LMCache")
    e2e.add_argument("--workdir", help="keep SSD files, stats and logs here (default: a temp dir)")
    e2e.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    e2e.set_defaults(func=_e2e)


def _register_redis(suites) -> None:
    red = suites.add_parser("redis", help="Redis tier against plain redis-py and loopback TCP")
    red.add_argument("--redis", metavar="URL",
                     help="benchmark this Redis (default: start a redis-server on a free port)")
    red.add_argument("--json", help="write the rows as JSON to this file")
    red.add_argument("--repeat", type=_positive, default=5, help="repetitions per figure (median)")
    red.set_defaults(func=_redis)


def _redis(args) -> int:
    from kvstore.bench import redis as bench_redis

    return bench_redis.run(args)


def _register_store(suites) -> None:
    from kvstore.cli import size_arg

    store = suites.add_parser("store", help="the store process: lookup, shm and stream gets/puts, "
                                            "concurrent clients")
    store.add_argument("--target", help="HOST:PORT of a running store (default: start one here)")
    store.add_argument("--token", help="bearer token for the store")
    store.add_argument("--json", help="write the rows as JSON to this file")
    store.add_argument("--repeat", type=_positive, default=7, help="repetitions per figure (median)")
    store.add_argument("--sizes", type=_size_list, default=[1 << 20, 32 << 20],
                       help="object sizes for get/put rows, comma-separated (default 1MiB,32MiB)")
    store.add_argument("--clients", type=_int_list, default=[1, 4, 16],
                       help="concurrent client processes, comma-separated (default 1,4,16)")
    store.add_argument("--client-size", type=size_arg("--client-size"), default=32 << 20,
                       help="object size the concurrent clients get (default 32MiB)")
    store.add_argument("--client-objects", type=_positive, default=8,
                       help="distinct objects the concurrent clients read (default 8)")
    store.add_argument("--host-capacity", type=size_arg("--host-capacity"),
                       help="host pool of the store started here (default: what the run needs)")
    store.set_defaults(func=_store)


def _size_list(value: str) -> list[int]:
    import argparse

    from kvstore.config import parse_size
    from kvstore.errors import ConfigError

    try:
        return [parse_size(v.strip(), "--sizes") for v in value.split(",") if v.strip()]
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _int_list(value: str) -> list[int]:
    return [_positive(v.strip()) for v in value.split(",") if v.strip()]


def _store(args) -> int:
    from kvstore.bench import store

    return store.run(args)


def _positive(value: str) -> int:
    import argparse

    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _tiers(args) -> int:
    from kvstore.bench import tiers

    if args.repeat < 1:
        from kvstore.errors import ConfigError

        raise ConfigError("--repeat must be at least 1")
    return tiers.run(args)


def _e2e(args) -> int:
    from kvstore.bench import e2e

    return e2e.run(args)
