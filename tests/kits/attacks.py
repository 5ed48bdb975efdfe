"""Attack drivers of issue 23 (bounds on what a client can make ``kvstore serve`` hold), on
the client side, for the hostile tests (``tests/integration/test_hostile_*.py``) and the
tenant load test (``tests/integration/test_tenant_load.py``).

* ``Trickle``, ``StalledPut``, ``Silent``, ``describe``: one hostile call each, the building
  blocks of the single-attack tests.
* ``ATTACKERS``: whole attackers for the load test, each the body of one process that
  repeats its attack until a deadline and counts every attempt by how the server answered
  (``attempt:outcome``).  ``run`` is the process entry: it lowers the process to nice 19
  first (on 2 cores an attacker at full priority measures CPU contention, not the server).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import ObjectKey
from tests.kits.hostile import keys, open_now
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, key_fields, rpc_code

Code = grpc.StatusCode
MAX_TOKENS = 1 << 16  # token ids of one described object (the server's limit)


class Trickle:
    """A PutStream announcing ``size`` bytes that sends 1 KiB every ``every`` s, ``frames``
    times, then waits for ``stop()``: it is still sending until ``exhausted`` is set.
    ``code`` is how the server ended it and ``while_sending`` whether that came before the
    trickle ran out."""

    def __init__(self, client: StoreClient, key: ObjectKey, size: int, frames: int = 40, every: float = 0.25) -> None:
        self.release, self.exhausted = threading.Event(), threading.Event()
        self.code: Code | None = None
        self.while_sending: bool | None = None
        self._paced = threading.Event()
        gen = self._frames(key, size, frames, every)
        self.thread = threading.Thread(target=self._run, args=(client, gen), daemon=True)
        self.thread.start()

    def _run(self, client: StoreClient, gen: Iterator[pb.PutFrame]) -> None:
        code = rpc_code(lambda: client.put_frames(gen))
        self.while_sending = not self.exhausted.is_set()
        self.code = code

    def _frames(self, key: ObjectKey, size: int, frames: int, every: float) -> Iterator[pb.PutFrame]:
        yield pb.PutFrame(start=pb.PutStartRequest(size=size, **key_fields(key)))
        for _ in range(frames):
            if self._paced.wait(every):
                return
            yield pb.PutFrame(data=b"\0" * KiB)
        self.exhausted.set()
        self.release.wait(60)

    def stop(self) -> None:
        self._paced.set()
        self.release.set()
        self.thread.join(30)


class StalledPut:
    """A PutStream that announces ``size`` bytes, sends one frame and then goes silent
    until ``stop()``; ``code`` is how the server ended it."""

    def __init__(self, client: StoreClient, key: ObjectKey, obj: memoryview, size: int) -> None:
        self.release = threading.Event()
        self.code: Code | None = None
        frames = self._frames(key, obj, size)
        self.thread = threading.Thread(
            target=lambda: setattr(self, "code", rpc_code(lambda: client.put_frames(frames))), daemon=True
        )
        self.thread.start()

    def _frames(self, key: ObjectKey, obj: memoryview, size: int) -> Iterator[pb.PutFrame]:
        yield pb.PutFrame(start=pb.PutStartRequest(size=size, **key_fields(key)))
        yield pb.PutFrame(data=bytes(obj[:MiB]))
        self.release.wait(30)

    def stop(self) -> None:
        self.release.set()
        self.thread.join(30)


class Silent:
    """A call of ``method`` (a single-request RPC) whose request never comes: its headers
    (and ``token``'s metadata) are sent, then nothing until ``stop()``.  ``code`` is how the
    server ended it and ``while_silent`` whether that came before ``stop()``."""

    def __init__(self, channel: grpc.Channel, method: str, token: str | None = None) -> None:
        self.release = threading.Event()
        self.code: Code | None = None
        self.while_silent: bool | None = None
        call = channel.stream_unary(
            f"/kvstore.v1.KVStore/{method}", request_serializer=lambda m: m, response_deserializer=lambda raw: raw
        )
        meta = (("authorization", f"Bearer {token}"),) if token else None
        self.future = call.future(self._nothing(), metadata=meta, timeout=60)
        self.future.add_done_callback(self._done)

    def _nothing(self) -> Iterator[bytes]:
        self.release.wait(60)
        return
        yield

    def _done(self, fut: grpc.Future) -> None:
        self.while_silent = not self.release.is_set()
        self.code = fut.code()

    def stop(self) -> None:
        self.release.set()
        self.future.cancel()


def describe(client: StoreClient, keys_: list[ObjectKey], n_tokens: int) -> list[Code]:
    """Describe each of ``keys_`` (one call each) with ``n_tokens`` tokens; the codes."""
    codes = []
    for k in keys_:
        req = pb.DescribeRequest(
            namespace=bytes(k.namespace),
            tag=k.tag,
            objects=[pb.ObjectDescription(chunk_hash=bytes(k.chunk_hash), token_ids=list(range(n_tokens)))],
        )
        codes.append(rpc_code(lambda: client.call("Describe", req)))
    return codes


# --- whole attackers of the load test: fn(target, tokens, deadline, counts) -----------------
# ``tokens``: "rw" (the attacker tenant's writer) and "ro" (its read-only token).


def describe_flood(target: str, tokens: dict[str, str], deadline: float, counts: Counter) -> None:
    """Holds 8 small objects and describes them again and again with the most tokens a call
    allows (256 KiB of descriptions each): refused beyond the tenant's ``described_bytes``."""
    mine, objects = keys(8, seed=2301), Objects(64 * KiB)
    with StoreClient(target, tokens["rw"]) as c:
        for k in mine:
            counts[f"describe_put:{pb.PutOutcome.Name(c.put_stream(k, objects.make(k, 64 * KiB)))}"] += 1
        while time.monotonic() < deadline:
            for code in describe(c, mine, MAX_TOKENS):
                counts[f"describe:code:{code.name}"] += 1


def refused_streams(target: str, tokens: dict[str, str], deadline: float, counts: Counter, batch: int = 64) -> None:
    """``batch`` PutStreams at once, half from the read-only token (no ``write``), half beyond
    the tenant's ``streams``, each still sending when answered; again until the deadline."""
    seed = 2310
    with StoreClient(target, tokens["rw"]) as rw, StoreClient(target, tokens["ro"]) as ro:
        while time.monotonic() < deadline:
            seed += 1
            calls = [
                Trickle(ro if i % 2 else rw, k, 64 * KiB, frames=40, every=0.1)  # cut after ~1 s
                for i, k in enumerate(keys(batch, seed=seed))
            ]
            for t in calls:
                t.thread.join(10)
                state = "while_sending" if t.while_sending else "after_sending"
                counts[f"refused_stream:code:{t.code.name if t.code else 'NONE'}:{state}"] += 1
                t.stop()


def silent_calls(target: str, tokens: dict[str, str], deadline: float, counts: Counter, batch: int = 96) -> None:
    """``batch`` calls with no token that never send their request (refused at once), and 4
    with the tenant's token (cut after ``request_timeout``); again until the deadline."""
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        while time.monotonic() < deadline:
            calls = [Silent(channel, ("Hello", "Lookup", "GetStream", "OpenData")[i % 4]) for i in range(batch)]
            calls += [Silent(channel, m, tokens["rw"]) for m in ("Hello", "Lookup", "OpenData", "Stats")]
            end = time.monotonic() + 10
            while time.monotonic() < end and any(c.code is None for c in calls):
                time.sleep(0.05)
            for i, c in enumerate(calls):
                who = "token" if i >= batch else "none"
                state = "while_silent" if c.while_silent else "after_stop"
                c.stop()
                counts[f"silent_call:{who}:code:{c.code.name if c.code else 'NONE'}:{state}"] += 1
    finally:
        channel.close()


def ticket_minting(target: str, tokens: dict[str, str], deadline: float, counts: Counter) -> None:
    """The read-only token mints ``OpenData`` tickets and never redeems them."""
    with StoreClient(target, tokens["ro"]) as ro:
        while time.monotonic() < deadline:
            counts[f"ticket:code:{rpc_code(lambda: ro.call('OpenData', pb.OpenDataRequest())).name}"] += 1


def _hold(socks: list[socket.socket], counts: Counter, what: str, hello_timeout: float = 2.0) -> None:
    """Count how ``socks`` (connections that never send a hello) end: closed at once, cut
    once the hello deadline passed, or still open well after it; and the most held at once."""
    time.sleep(0.3)
    held = [s for s in socks if open_now(s)]
    counts[f"{what}:closed_at_once"] += len(socks) - len(held)
    counts[f"{what}:most_held"] = max(counts[f"{what}:most_held"], len(held))  # in any one round
    time.sleep(hello_timeout + 1.5)
    still = sum(open_now(s) for s in held)
    counts[f"{what}:cut_after_hello_timeout"] += len(held) - still
    counts[f"{what}:open_past_deadline"] += still
    for s in socks:
        s.close()


def data_strangers(
    target: str, tokens: dict[str, str], deadline: float, counts: Counter, peers: int = 8, each: int = 64
) -> None:
    """``each`` data-channel connections from each of ``peers`` loopback addresses
    (127.0.0.2...; not the good clients' 127.0.0.1) that never send a hello; again."""
    with StoreClient(target, tokens["rw"]) as c:
        port = c.call("OpenData", pb.OpenDataRequest()).data_port
    while time.monotonic() < deadline:
        socks = []
        for p in range(peers):
            for _ in range(each):
                try:
                    socks.append(
                        socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(f"127.0.0.{2 + p}", 0))
                    )
                except OSError:
                    counts["data_stranger:connect_refused"] += 1
        _hold(socks, counts, "data_stranger")


def gate_strangers(target: str, tokens: dict[str, str], deadline: float, counts: Counter, n: int = 600) -> None:
    """``n`` connections to the shared-memory gate that never send a hello; again."""
    with StoreClient(target, tokens["rw"]) as c:
        path = c.hello().shm_socket
    while time.monotonic() < deadline:
        socks = []
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                socks.append(s)
            except OSError:
                s.close()
                counts["gate_stranger:connect_refused"] += 1
        _hold(socks, counts, "gate_stranger")


def ssd_flood(target: str, tokens: dict[str, str], deadline: float, counts: Counter) -> None:
    """Small objects (1 KiB) as fast as it can put them: each one written through to the SSD
    tier, on top of the tenant's objects already there."""
    objects, seed = Objects(KiB), 2330
    with StoreClient(target, tokens["rw"]) as c:
        while time.monotonic() < deadline:
            seed += 1
            for k in keys(64, seed=seed):
                try:
                    counts[f"ssd_put:{pb.PutOutcome.Name(c.put_stream(k, objects.make(k, KiB)))}"] += 1
                except grpc.RpcError as err:
                    counts[f"ssd_put:code:{err.code().name}"] += 1


ATTACKERS: dict[str, Callable[[str, dict[str, str], float, Counter], None]] = {
    "describe_flood": describe_flood,
    "refused_streams": refused_streams,
    "silent_calls": silent_calls,
    "ticket_minting": ticket_minting,
    "data_strangers": data_strangers,
    "gate_strangers": gate_strangers,
    "ssd_flood": ssd_flood,
}


def run(name: str, target: str, tokens: dict[str, str], seconds: float, out) -> None:
    """Process entry: at nice 19, attacker ``name`` for ``seconds``; its counters go to ``out``."""
    os.nice(19)
    deadline = time.monotonic() + seconds
    counts: Counter = Counter()
    try:
        ATTACKERS[name](target, tokens, deadline, counts)
    except BaseException as err:  # noqa: BLE001 - reported, the parent fails the test
        counts[f"crashed:{type(err).__name__}:{err}"] += 1
    out.put((name, "", dict(counts)))


__all__ = ["ATTACKERS", "MAX_TOKENS", "Silent", "StalledPut", "Trickle", "describe", "run"]
