"""``kvstore bench <suite>``: benchmarks beside limits measured in the same run."""

from __future__ import annotations


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each figure beside its same-run limit")
    suites = bench.add_subparsers(dest="suite", required=True)
    tiers = suites.add_parser("tiers", help="host DRAM and SSD tiers, hashing and lookup")
    tiers.add_argument("--dir", help="directory for SSD files (default: system temp dir)")
    tiers.add_argument("--json", help="write the rows as JSON to this file")
    tiers.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    tiers.add_argument("--repeat", type=int, default=7, help="repetitions per figure (median)")
    tiers.add_argument(
        "--growth",
        action="store_true",
        help="instead: put/lookup p50/p99 as the tiers fill (docs/store-bounds.md#how-cost-grows)",
    )
    tiers.add_argument(
        "--host-sizes",
        type=_int_list,
        default=[10_000, 100_000, 1_000_000],
        help="--growth: host tier object counts (default 10000,100000,1000000)",
    )
    tiers.add_argument(
        "--ssd-sizes",
        type=_int_list,
        default=[10_000, 100_000, 300_000],
        help="--growth: SSD tier object counts, files written before it starts (default 10000,100000,300000)",
    )
    tiers.add_argument(
        "--tenants",
        type=_int_list,
        default=[1, 4],
        help="--growth: tenant counts, objects spread over their namespaces (default 1,4)",
    )
    tiers.add_argument(
        "--ops", type=positive, default=2000, help="--growth: timed operations of each kind per size (default 2000)"
    )
    tiers.set_defaults(func=_tiers)
    _register_store(suites)
    _register_redis(suites)
    _register_trace(suites)
    _register_plugins(suites)


def _register_plugins(suites) -> None:
    """Suites of other packages, declared as ``kvstore.bench`` entry points (``e2e`` comes
    from the connector: it runs real engines, and this package never imports the engine)."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group="kvstore.bench"), key=lambda e: e.name):
        ep.load()(suites)


def _register_trace(suites) -> None:
    trace = suites.add_parser(
        "trace",
        help="a request trace (Mooncake's JSON lines) through the host "
        "tier's policy, beside plain LRU and Belady's MIN",
    )
    trace.add_argument(
        "file", help="the trace: one JSON object a line (timestamp, input_length, output_length, hash_ids)"
    )
    trace.add_argument(
        "--fractions",
        type=_fraction_list,
        default=None,
        help="host capacities as fractions of the trace's distinct blocks, comma-separated (default 0.02,0.05,0.1)",
    )
    trace.add_argument(
        "--capacity-blocks", type=positive, default=None, help="one host capacity, in blocks (instead of --fractions)"
    )
    trace.add_argument("--json", help='write {"rows": [...]} to this file')
    trace.add_argument(
        "--retention",
        choices=["reuse", "adaptive", "lru"],
        default="reuse",
        help="the host tier's retention policy measured as ours (default reuse; tiers.retention)",
    )
    trace.set_defaults(func=_trace)


def _fraction_list(value: str) -> list[float]:
    import argparse

    out = []
    for v in value.split(","):
        try:
            f = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a fraction: {v!r}") from None
        if not 0 < f <= 1:
            raise argparse.ArgumentTypeError(f"a fraction must be in (0, 1], got {v!r}")
        out.append(f)
    return out


def _trace(args) -> int:
    from kvstore.bench import trace

    if args.fractions is not None and args.capacity_blocks is not None:
        from kvstore.errors import ConfigError

        raise ConfigError("give --fractions or --capacity-blocks, not both")
    return trace.run(args)


def _register_redis(suites) -> None:
    red = suites.add_parser("redis", help="Redis tier against plain redis-py and loopback TCP")
    red.add_argument(
        "--redis", metavar="URL", help="benchmark this Redis (default: start a redis-server on a free port)"
    )
    red.add_argument("--json", help="write the rows as JSON to this file")
    red.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    red.add_argument("--repeat", type=positive, default=5, help="repetitions per figure (median)")
    red.set_defaults(func=_redis)


def _redis(args) -> int:
    from kvstore.bench import redis as bench_redis

    return bench_redis.run(args)


def _register_store(suites) -> None:
    from kvstore.cli.args import add_token_args, size_arg

    store = suites.add_parser("store", help="the store process: lookup, shm and stream gets/puts, concurrent clients")
    store.add_argument("--target", help="HOST:PORT of a running store (default: start one here)")
    add_token_args(store)
    store.add_argument("--json", help="write the rows as JSON to this file")
    store.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    store.add_argument("--repeat", type=positive, default=7, help="repetitions per figure (median)")
    store.add_argument(
        "--sizes",
        type=_size_list,
        default=[1 << 20, 32 << 20],
        help="object sizes for get/put rows, comma-separated (default 1MiB,32MiB)",
    )
    store.add_argument(
        "--clients",
        type=_int_list,
        default=[1, 4, 16],
        help="concurrent client processes, comma-separated (default 1,4,16)",
    )
    store.add_argument(
        "--client-size",
        type=size_arg("--client-size"),
        default=32 << 20,
        help="object size the concurrent clients get (default 32MiB)",
    )
    store.add_argument(
        "--client-objects", type=positive, default=8, help="distinct objects the concurrent clients read (default 8)"
    )
    store.add_argument(
        "--host-capacity",
        type=size_arg("--host-capacity"),
        help="host pool of the store started here (default: what the run needs)",
    )
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
    return [positive(v.strip()) for v in value.split(",") if v.strip()]


def _store(args) -> int:
    from kvstore.bench import store
    from kvstore.cli.args import token_of

    args.token = token_of(args)
    return store.run(args)


def positive(value: str) -> int:
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
