"""The cast of the adversarial-tenant tests: one real ``kvstore serve`` with a well-behaved
tenant ``a`` (two writers and a reader), a hostile tenant ``b`` (writer and reader, small
quotas) and an ``ops`` admin, short TTLs and tight stream deadlines so attacks end fast.

Everything goes through real processes and sockets: ``tests.kits.store_calls.StoreClient``
(plain gRPC stubs; shared memory through a real session with the server's gate) and
``tests.kits.data_channel.RawData`` (raw data-channel sockets).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import yaml

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import ChunkHash, Namespace, ObjectKey
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import MiB, StoreClient

TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-a2", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-a-ro", "tenant": "a", "permissions": ["read", "shm"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
    {"token": "tok-b-ro", "tenant": "b", "permissions": ["read", "shm"]},
    {"token": "tok-c-ro", "tenant": "c", "permissions": ["read", "shm"]},  # no writer at all
    {"token": "tok-ops", "tenant": "ops", "permissions": ["read", "admin"]},
]
QUOTAS = {
    "a": {"host_bytes": "16MiB", "ssd_bytes": "32MiB"},
    "b": {"host_bytes": "16MiB", "ssd_bytes": "16MiB", "streams": 2, "leases": 4, "reservations": 2, "connections": 6},
}
HOST, SSD = "40MiB", "64MiB"  # c and ops share what a and b leave
STREAM_RATE, GRACE = 32 * MiB, 1.0  # a stream of N bytes is cut after GRACE + N / STREAM_RATE s
PUT_TTL = 1.0


def write_tokens(path: Path, tokens=TOKENS, quotas=QUOTAS) -> Path:
    path.write_text(yaml.safe_dump({"tokens": tokens, "tenants": quotas}))
    return path


def start_store(work: Path, *extra: str, quotas=QUOTAS, tokens=TOKENS) -> StoreProcess:
    tokens = write_tokens(work / "tokens.yaml", tokens=tokens, quotas=quotas)
    return StoreProcess(
        work,
        "--host-capacity",
        HOST,
        "--auth-tokens",
        str(tokens),
        "--ssd-dir",
        str(work / "ssd"),
        "--ssd-capacity",
        SSD,
        "--put-ttl",
        str(PUT_TTL),
        "--lease-ttl",
        "5",
        "--stream-min-rate",
        str(STREAM_RATE),
        "--stream-grace",
        str(GRACE),
        "--idle-timeout",
        "3",
        "--metrics-port",
        "0",
        *extra,
    ).start()


def keys(n: int, seed: int, tag: str = "r0") -> list[ObjectKey]:
    """``n`` keys of one namespace (one chain as far as the store cares)."""
    rng = np.random.default_rng(seed)
    ns = Namespace(rng.bytes(32))
    return [ObjectKey(ns, ChunkHash(rng.bytes(32)), tag) for _ in range(n)]


def refused(target: str, token: str) -> dict[str, float]:
    """The ``refused.*`` counters of ``token``'s tenant, as its own ``Stats`` shows them."""
    with StoreClient(target, token) as c:
        return {k.split(".", 1)[1]: v for k, v in c.stats()[1].items() if k.startswith("refused.")}


def open_now(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` open: what it sent (an error reply) is read
    and dropped; open until EOF or a reset."""
    timeout = sock.gettimeout()
    sock.settimeout(0)  # a socket with a timeout would wait for data despite MSG_DONTWAIT
    try:
        while sock.recv(4096, socket.MSG_DONTWAIT):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(timeout)


def admin_counters(target: str) -> dict[str, float]:
    with StoreClient(target, "tok-ops") as ops:
        return ops.stats()[1]


def admin_doc(target: str) -> dict:
    with StoreClient(target, "tok-ops") as ops:
        return ops.stats()[0]


def quiet(target: str) -> bool:
    """Nothing held: no lease, reservation (fenced included), reference or pending slot."""
    c = admin_counters(target)
    return (c["leases_held"], c["puts_in_flight"], c["puts_fenced"], c["host.refs_held"], c["host.pending"]) == (
        0,
        0,
        0,
        0,
        0,
    )


def get_request(key: ObjectKey, lease_ms: int = 0) -> pb.GetRequest:
    return pb.GetRequest(
        namespace=bytes(key.namespace), chunk_hash=bytes(key.chunk_hash), tag=key.tag, lease_ms=lease_ms
    )


__all__ = [
    "GRACE",
    "PUT_TTL",
    "QUOTAS",
    "STREAM_RATE",
    "TOKENS",
    "admin_counters",
    "admin_doc",
    "get_request",
    "keys",
    "quiet",
    "start_store",
    "write_tokens",
]


def fd_links(pid: int) -> list[str]:
    """Where each open descriptor of process ``pid`` points.  A descriptor that closes
    between the listing and its readlink (a connection going away meanwhile) is left out."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return links
