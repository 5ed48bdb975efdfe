"""Helpers of ``kvstore bench store`` that run in other processes: the plain grpcio peer
and the concurrent shared-memory clients.

* ``RawGrpcPeer`` starts (in a spawned process) a grpc.aio server with one generic handler
  of raw bytes, no protobuf: ``Get`` answers a preallocated payload of the size asked,
  ``Put`` swallows the request and answers one byte, ``Ping`` answers one byte.  It is the
  naive peer the store's streams are compared with (docs/limits.md#grpc: ~0.3 GB/s at 32 MiB).
* ``run_clients(n, ...)`` starts ``n`` processes, each with its own ``StoreClient`` over
  shared memory; they meet at a barrier, then each reads ``gets`` objects into its own
  reused buffer.  The answer: aggregate GB/s over the common window and latency samples.
* ``write_tokens`` writes the tokens file of the store the bench starts (two tenants: one
  for every row, one whose pool is sealed).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import yaml

MiB = 1 << 20
_SERVICE = "bench.Raw"
_START_TIMEOUT_S = 120.0
_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_http_proxy", 0),
]


# --- the plain grpcio peer ------------------------------------------------------------


def _raw_main(port_q) -> None:
    asyncio.run(_raw_serve(port_q))


async def _raw_serve(port_q) -> None:
    blobs: dict[int, bytes] = {}

    async def get(request: bytes, context) -> bytes:
        n = int.from_bytes(request, "little")
        blob = blobs.get(n)
        if blob is None:
            blob = blobs[n] = b"\x5a" * n  # allocated once per size, like a cached object
        return blob

    async def one_byte(request: bytes, context) -> bytes:
        return b"k"

    handlers = {
        "Get": grpc.unary_unary_rpc_method_handler(get),
        "Put": grpc.unary_unary_rpc_method_handler(one_byte),
        "Ping": grpc.unary_unary_rpc_method_handler(one_byte),
    }
    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    await server.wait_for_termination()


class RawGrpcPeer:
    """The plain grpcio server process and an aio client of it (one event loop)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self._proc = ctx.Process(target=_raw_main, args=(q,), name="kvstore-bench-raw-grpc", daemon=True)
        self._proc.start()
        port = q.get(timeout=_START_TIMEOUT_S)
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS)
        self._get = self._channel.unary_unary(f"/{_SERVICE}/Get")
        self._put = self._channel.unary_unary(f"/{_SERVICE}/Put")
        self._ping = self._channel.unary_unary(f"/{_SERVICE}/Ping")

    async def get(self, n: int) -> int:
        return len(await self._get(n.to_bytes(8, "little"), timeout=60))

    async def put(self, data: bytes) -> None:
        await self._put(data, timeout=60)

    async def ping(self) -> None:
        await self._ping(b"p", timeout=10)

    async def aclose(self) -> None:
        await self._channel.close()
        self._proc.terminate()
        self._proc.join(timeout=10)


# --- concurrent clients -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientsResult:
    clients: int
    aggregate_gbps: float
    latencies_s: tuple[float, ...]

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3


def _client_main(
    i: int, target: str, token: str | None, keys: list[bytes], size: int, gets: int, barrier, out_q
) -> None:
    try:
        out_q.put(asyncio.run(_client_run(i, target, token, keys, size, gets, barrier)))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()
        out_q.put(f"client {i}: {type(err).__name__}: {err}")


async def _client_run(
    i: int, target: str, token: str | None, keys: list[bytes], size: int, gets: int, barrier
) -> tuple[float, float, list[float]]:
    from kvstore.client.store_client import StoreClient
    from kvstore.keys import ObjectKey

    objs = [ObjectKey.from_bytes(k) for k in keys]
    buf = np.empty(size, np.uint8)
    buf.fill(0)  # prefaulted: reused for every get
    view = memoryview(buf)
    async with await StoreClient.connect(target, token=token, transport="shm", timeout_s=30) as client:
        if await client.read_into(objs[i % len(objs)], view) != size:  # warm up
            raise RuntimeError("warm-up get missed")
        barrier.wait(timeout=_START_TIMEOUT_S)
        lats = []
        start = time.monotonic()
        for j in range(gets):
            t0 = time.perf_counter()
            n = await client.read_into(objs[(i + j) % len(objs)], view)
            lats.append(time.perf_counter() - t0)
            if n != size:
                raise RuntimeError(f"get {j} answered {n}, expected {size} bytes")
        return start, time.monotonic(), lats


def run_clients(n: int, target: str, token: str | None, keys: list[bytes], size: int, gets: int) -> ClientsResult:
    """``n`` client processes, each getting ``gets`` objects of ``size`` bytes over shm."""
    ctx = mp.get_context("spawn")
    barrier, out_q = ctx.Barrier(n + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_main,
            args=(i, target, token, keys, size, gets, barrier, out_q),
            name=f"kvstore-bench-client-{i}",
            daemon=True,
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait(timeout=_START_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a client failed to start: its message says why
            pass
        results = [out_q.get(timeout=_START_TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    window = max(r[1] for r in results) - min(r[0] for r in results)
    lats = tuple(x for r in results for x in r[2])
    return ClientsResult(n, n * gets * size / window / 1e9, lats)


# --- the store's tokens ------------------------------------------------------------------


def write_tokens(path: Path, capacity: int, largest: int) -> tuple[dict[str, str], int]:
    """A tokens file (0600) for the store ``kvstore bench store`` starts: tenant ``bench``
    (read, write, shm: every row but one; ``capacity`` bytes of host pool) and tenant
    ``sealed``, whose writer has no ``shm`` and whose reader has no ``write`` (its pool is
    sealed; room for two objects of ``largest`` bytes).  (The tokens by role, the sealed
    pool's bytes.)"""
    tokens = {role: secrets.token_urlsafe(24) for role in ("bench", "sealed-writer", "sealed-reader")}
    sealed_bytes = 2 * largest + 16 * MiB
    doc = {
        "tokens": [
            {"token": tokens["bench"], "tenant": "bench", "permissions": ["read", "write", "shm"]},
            {"token": tokens["sealed-writer"], "tenant": "sealed", "permissions": ["read", "write"]},
            {"token": tokens["sealed-reader"], "tenant": "sealed", "permissions": ["read", "shm"]},
        ],
        "tenants": {"bench": {"host_bytes": capacity}, "sealed": {"host_bytes": sealed_bytes}},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(doc, f)
    return tokens, sealed_bytes


__all__ = ["ClientsResult", "RawGrpcPeer", "run_clients", "write_tokens"]
