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


def _tiers(args) -> int:
    from kvstore.bench import tiers

    if args.repeat < 1:
        from kvstore.errors import ConfigError

        raise ConfigError("--repeat must be at least 1")
    return tiers.run(args)
