"""``kvstore serve`` (the store process) and ``kvstore stats`` (a readable summary of one).

Flags are not given defaults here: a flag left out falls through to ``KVSTORE_SERVE_*``
environment variables, then the ``--config`` YAML file, then the defaults of
``kvstore.server.config.ServerConfig``.  Nothing heavy is imported at parse time, so
``kvstore serve`` starts in well under a second (no torch, no vLLM).
"""
from __future__ import annotations

import json
from kvstore.config import WritePolicy

_SERVE_FLAGS: tuple[tuple[str, str], ...] = (
    ("--listen", "HOST:PORT to serve on (port 0: a free port; default 127.0.0.1:50051)"),
    ("--host-capacity", "size of the shared host DRAM pool (e.g. 8GiB; default 1GiB)"),
    ("--ssd-dir", "directory of the SSD tier (off when not given)"),
    ("--ssd-capacity", "size limit of the SSD tier (default 16GiB)"),
    ("--redis", "URL of the Redis tier, the lowest tier (redis://host:port/db)"),
    ("--auth-tokens", "YAML tokens file; without it every call is tenant 'default'"),
    ("--tls-cert", "server certificate (PEM)"),
    ("--tls-key", "server private key (PEM)"),
    ("--tls-client-ca", "require client certificates signed by this CA (PEM)"),
    ("--metrics-port", "serve Prometheus /metrics on this port (0: a free port)"),
    ("--metrics-host", "address of /metrics (default: the --listen host)"),
    ("--lease-ttl", "default lease TTL in seconds (default 30)"),
    ("--max-lease-ttl", "longest lease a client may ask for, seconds (default 300)"),
    ("--put-ttl", "seconds an uncommitted PutStart reservation lives (default: --lease-ttl)"),
    ("--ready-file", "write the bound HOST:PORT here once serving"),
    ("--max-object-bytes", "largest object accepted (default 256MiB)"),
    ("--max-keys-per-call", "most keys in one Lookup / lease ids in one ReleaseLease (default 4096)"),
    ("--max-message-bytes", "gRPC receive limit (default 8MiB; at least frame bytes + 64KiB)"),
    ("--frame-bytes", "GetStream frame size (default 1MiB)"),
    ("--shutdown-grace", "seconds in-flight calls get at SIGTERM (default 10)"),
)


def register(sub) -> None:
    serve = sub.add_parser("serve", help="run the store process (gRPC, shared memory, tiers)")
    for flag, text in _SERVE_FLAGS:
        serve.add_argument(flag, help=text)
    serve.add_argument("--config", help="YAML file of settings (flags and KVSTORE_SERVE_* win)")
    serve.add_argument("--write-policy", choices=[p.value for p in WritePolicy if p is not WritePolicy.WRITE_BACK],
                       help="write_through (default: copy committed puts to the lower tiers) or "
                            "host_only (lower tiers are read and promoted from, never written)")
    serve.add_argument("--no-write-through", dest="write_policy", action="store_const", const="host_only",
                       help="the same as --write-policy host_only")
    serve.set_defaults(func=_serve)

    stats = sub.add_parser("stats", help="print a store process's counters")
    stats.add_argument("--target", required=True, help="HOST:PORT of the store process")
    stats.add_argument("--token", help="bearer token (when the store has --auth-tokens)")
    stats.add_argument("--tls-ca", help="CA certificate (PEM) to reach a TLS store")
    stats.add_argument("--tls-cert", help="client certificate (PEM) for a store that requires one")
    stats.add_argument("--tls-key", help="client private key (PEM)")
    stats.add_argument("--json", action="store_true", help="print the full JSON document")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    stats.set_defaults(func=_stats)


def _serve(args) -> int:
    from kvstore.server.config import ServerConfig
    from kvstore.server.main import run

    flags = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    return run(ServerConfig.from_sources(flags))


def _stats(args) -> int:
    import grpc

    from kvstore._proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
    from kvstore.errors import ConfigError, TierUnavailableError

    channel = _channel(args)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        reply = pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as err:
        code = err.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise ConfigError(f"{args.target} refused the token: {code.name}: {err.details()}") from err
        raise TierUnavailableError(f"{args.target}: {code.name}: {err.details()}") from err
    finally:
        channel.close()
    doc = json.loads(reply.json)
    print(json.dumps(doc, indent=1, sort_keys=True) if args.json else format_stats(doc, args.target))
    return 0


def _channel(args):
    import grpc

    from kvstore.errors import ConfigError

    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(args.target)

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise ConfigError(f"cannot read {path}: {err.strerror or err}") from err

    creds = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    return grpc.secure_channel(args.target, creds)


def _rate(hits: float, total: float, what: str) -> str:
    pct = f" ({100.0 * hits / total:.1f}%)" if total else ""
    return f"{int(hits)}/{int(total)} {what}{pct}"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_stats(doc: dict, target: str) -> str:
    """The readable summary of a ``Stats`` document."""
    s, tiers = doc["store"], doc["tiers"]
    hits = sum(s["lookup_hits"].values())
    by_tier = ", ".join(f"{t} {int(n)}" for t, n in sorted(s["lookup_hits"].items())) or "none"
    lines = [
        f"kvstore store at {target} (pid {doc['server']['pid']}, up {doc['server']['uptime_s']:.0f} s)",
        f"  hit rate     {_rate(hits, s['lookup_keys'], 'hit keys / looked-up keys')}"
        f" over {s['lookups']} lookups; hits by tier: {by_tier}",
        f"  gets         {_counts(s['gets'])}; misses {_counts(s['get_misses'])}",
        f"  puts         {_counts(s['puts'])}",
        f"  leases       held {doc['leases']['held']}, expired {doc['leases']['expired']}, "
        f"granted {doc['leases']['granted']}; puts in flight {doc['puts_in_flight']}",
    ]
    for name, t in tiers.items():
        moved = ", ".join(f"{d} {_size(n)}" for (tn, d), n in _pairs(s["bytes"]) if tn == name)
        lines.append(f"  tier {name:<7} {int(t['objects'])} objects, {_size(t['bytes_used'])} of "
                     f"{_size(t['capacity_bytes'])}, evictions {int(t['evictions'])}, "
                     f"corrupt {int(t['corrupt'])}" + (f"; moved {moved}" if moved else ""))
    for name, b in doc.get("breakers", {}).items():
        lines.append(f"  breaker {name}: {'OPEN' if b.get('breaker_open') else 'closed'}")
    lines.append(f"  write-through {_counts(s['write_through'])}")
    lines.append(f"  failures     {_counts(s['failures'])}")
    return "\n".join(lines)


def _pairs(table: dict[str, float]) -> list[tuple[tuple[str, str], float]]:
    return [(tuple(k.split(".", 1)), v) for k, v in sorted(table.items())]  # type: ignore[misc]


def _counts(table: dict[str, float]) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(table.items())) or "none"

