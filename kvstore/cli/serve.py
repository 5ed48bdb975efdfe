"""``kvstore serve`` (the store process), ``kvstore stats`` (a readable summary of one) and
``kvstore health`` (its ``grpc.health.v1`` status: a container health check, no token needed).

The flags are the fields of ``kvstore.server.config.ServerConfig`` (``lease_ttl`` is
``--lease-ttl``), with their docs as help.  Flags are not given defaults here: a flag left
out falls through to ``KVSTORE_SERVE_*`` environment variables, then the ``--config`` YAML
file, then the defaults of ``ServerConfig``.  Nothing heavy is imported at parse time, so
``kvstore serve`` starts in well under a second (no torch, no vLLM).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, Field, fields
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin

from kvstore.cli.args import add_token_args, token_of
from kvstore.config import Seconds, Size, field_types
from kvstore.server.config import ServerConfig, flag_name


def register(sub) -> None:
    serve = sub.add_parser("serve", help="run the store process (gRPC, shared memory, tiers)")
    types = field_types(ServerConfig)
    for f in fields(ServerConfig):  # one flag per setting, its help from the setting's doc
        if types[f.name] is bool:  # --insecure alone means true; --data-channel false too
            serve.add_argument(flag_name(f.name), metavar="BOOL", nargs="?", const="true", help=_help(f, types[f.name]))
            continue
        serve.add_argument(flag_name(f.name), metavar=_metavar(f.name, types[f.name]), help=_help(f, types[f.name]))
    serve.add_argument("--config", help="YAML file of settings (flags and KVSTORE_SERVE_* win)")
    serve.set_defaults(func=_serve)

    stats = sub.add_parser("stats", help="print a store process's counters")
    stats.add_argument("--target", required=True, help="HOST:PORT of the store process")
    add_token_args(stats)  # --token-file, --token, $KVSTORE_TOKEN (when the store has --auth-tokens)
    stats.add_argument("--tls-ca", help="CA certificate (PEM) to reach a TLS store")
    stats.add_argument("--tls-cert", help="client certificate (PEM) for a store that requires one")
    stats.add_argument("--tls-key", help="client private key (PEM)")
    stats.add_argument("--json", action="store_true", help="print the full JSON document")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    stats.set_defaults(func=_stats)

    health = sub.add_parser("health", help="exit 0 when a store process answers SERVING (grpc.health.v1)")
    health.add_argument(
        "--target", default="127.0.0.1:50051", help="HOST:PORT of the store process (default 127.0.0.1:50051)"
    )
    health.add_argument("--tls-ca", help="CA certificate (PEM) to reach a TLS store")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    health.set_defaults(func=_health, tls_cert=None, tls_key=None)


def _metavar(name: str, tp: object) -> str:
    inner = next((a for a in get_args(tp) if a is not type(None)), tp) if get_origin(tp) in (Union, UnionType) else tp
    names: dict[object, str] = {Size: "SIZE", Seconds: "SECONDS", int: "N", Path: "PATH"}
    return names.get(inner, name.upper())


def _help(f: Field, tp: object) -> str:
    """The setting's doc and its default (``%`` doubled: argparse formats help text)."""
    text, default = f.metadata["doc"].replace("`", ""), f.default
    if default in (None, MISSING):
        return text.replace("%", "%%")
    if isinstance(default, Enum):
        default = default.value
    elif isinstance(default, float):
        default = f"{default:g}"
    elif tp == Size:
        default = _exact_size(default)
    return f"{text} (default {default})".replace("%", "%%")


def _exact_size(n: int) -> str:
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n % s == 0), ("", 1))
    return f"{n // scale}{unit}"


def _serve(args) -> int:
    from kvstore.server.main import run

    flags = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    return run(ServerConfig.from_sources(flags))


def _stats(args) -> int:
    import grpc

    from kvstore._proto import kvstore_pb2 as pb
    from kvstore._proto import kvstore_pb2_grpc as pb_grpc
    from kvstore.errors import ConfigError, TierUnavailableError

    token = token_of(args)
    channel = _channel(args)
    metadata = [("authorization", f"Bearer {token}")] if token else None
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


def _health(args) -> int:
    """0 when the store's KVStore service is SERVING; 1 with the reason otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.server.wire import SERVICE

    channel = _channel(args)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=args.timeout
        )
    except grpc.RpcError as err:
        print(f"{args.target}: {err.code().name}: {err.details()}")
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


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


def format_tenant(doc: dict, target: str) -> str:
    """The readable summary of one tenant's ``Stats`` (a token without ``admin``)."""
    lines = [f"kvstore store at {target}: tenant {doc['tenant']} (its own counters only)"]
    for name, t in doc["tiers"].items():
        lines.append(
            f"  {name:<12} {int(t['objects'])} objects, {_size(t['bytes_used'])} of {_size(t['capacity_bytes'])}"
        )
    quota, held = doc["quota"], doc["held"]
    lines.append("  held / quota " + ", ".join(f"{k} {held[k]}/{quota[k]}" for k in held))
    lines.append(f"  puts in flight {doc['puts_in_flight']}; refused: {_counts(doc['refused'])}")
    return "\n".join(lines)


def format_stats(doc: dict, target: str) -> str:
    """The readable summary of a ``Stats`` document (one tenant's, or the whole server's)."""
    if "tenant" in doc:
        return format_tenant(doc, target)
    s, tiers = doc["store"], doc["tiers"]
    hits = sum(s["lookup_hits"].values())
    by_tier = (
        ", ".join(f"{t} {int(n)} ({100.0 * n / hits:.0f}%)" for t, n in sorted(s["lookup_hits"].items())) or "none"
    )
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
        lines.append(
            f"  tier {name:<7} {int(t['objects'])} objects, {_size(t['bytes_used'])} of "
            f"{_size(t['capacity_bytes'])}, evictions {int(t['evictions'])}, "
            f"corrupt {int(t['corrupt'])}" + (f"; moved {moved}" if moved else "")
        )
    for name, b in doc.get("breakers", {}).items():
        lines.append(f"  breaker {name}: {'OPEN' if b.get('breaker_open') else 'closed'}")
    lines.append(f"  write-through {_counts(s['write_through'])}")
    if doc.get("stage_latency"):
        lines.append("  stages       " + format_latency(doc["stage_latency"]))
    events = doc.get("kv_events")
    if events:
        rec = events.get("recorded", {})
        lines.append(
            f"  kv events    epoch {events.get('epoch', '-')}: stored {rec.get('stored', 0)}, removed "
            f"{rec.get('removed', 0)}, undescribed objects {rec.get('undescribed', 0)}, "
            f"dropped {rec.get('dropped', 0)}; streams " + ", ".join(sorted(events.get("streams", {})))
        )
    lines.append(f"  failures     {_counts(s['failures'])}")
    for name, t in doc.get("tenants", {}).items():
        refused = sum(t["refused"].values())
        lines.append(
            f"  tenant {name}: host {_size(t['tiers'].get('host', {}).get('bytes_used', 0))} of "
            f"{_size(t['quota']['host_bytes'])}, leases {t['held']['leases']}, refused {refused}"
        )
    return "\n".join(lines)


def format_latency(latency: dict[str, dict[str, float]]) -> str:
    """``stage p50/p99 ms`` of each stage (``kvstore.metrics.quantiles``)."""
    return (
        ", ".join(f"{stage} {q['p50'] * 1e3:.2f}/{q['p99'] * 1e3:.2f} ms" for stage, q in latency.items())
        + " (p50/p99)"
    )


def _pairs(table: dict[str, float]) -> list[tuple[tuple[str, str], float]]:
    return [(tuple(k.split(".", 1)), v) for k, v in sorted(table.items())]  # type: ignore[misc]


def _counts(table: dict[str, float]) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(table.items())) or "none"
