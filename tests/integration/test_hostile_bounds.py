"""Issue 23, part 1: bounds on what a client can make a real ``kvstore serve`` hold.  In each
test the attack runs (its attempts are counted) and fails: the server refuses or cuts the
attacker while tenant a keeps being served (docs/store-bounds.md)."""
from __future__ import annotations

import threading

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from tests.data_kit import RawData, ticket_of
from tests.hostile_kit import admin_counters, keys, quiet, start_store
from tests.store_helpers import KiB, MiB, Objects, StoreClient, key_fields, rpc_code, wait_until

Code = grpc.StatusCode
MAX_RPCS = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = start_store(tmp_path_factory.mktemp("hostile-bounds"), "--max-concurrent-rpcs", str(MAX_RPCS))
    yield proc
    assert proc.terminate(30) == 0


@pytest.fixture(scope="module")
def objects():
    return Objects(4 * MiB)


def refused(target: str, token: str) -> dict[str, float]:
    with StoreClient(target, token) as c:
        return {k.split(".", 1)[1]: v for k, v in c.stats()[1].items() if k.startswith("refused.")}


class Trickle:
    """A PutStream announcing ``size`` bytes that sends 1 KiB every ``every`` s, ``frames``
    times, then waits for ``stop()``: it is still sending until ``exhausted`` is set.
    ``code`` is how the server ended it and ``while_sending`` whether that came before the
    trickle ran out."""

    def __init__(self, client: StoreClient, key, size: int, frames: int = 40, every: float = 0.25) -> None:
        self.release, self.exhausted = threading.Event(), threading.Event()
        self.code: Code | None = None
        self.while_sending: bool | None = None
        self._paced = threading.Event()
        gen = self._frames(key, size, frames, every)
        self.thread = threading.Thread(target=self._run, args=(client, gen), daemon=True)
        self.thread.start()

    def _run(self, client, gen) -> None:
        code = rpc_code(lambda: client.put_frames(gen))
        self.while_sending = not self.exhausted.is_set()
        self.code = code

    def _frames(self, key, size, frames, every):
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


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_refused_put_streams_end_at_once_and_hold_no_rpc_slot(store, objects):
    """b's read-only token opens PutStreams it may not, and b opens more than its 2 streams;
    each is refused at once (counted) while its client still sends, so 2 x MAX_RPCS refused
    streams never fill the server's call slots and a's puts and hellos go on."""
    before = refused(store.target, "tok-b")
    mine = keys(3, seed=300)
    with StoreClient(store.target, "tok-b") as b, StoreClient(store.target, "tok-b-ro") as ro, \
            StoreClient(store.target, "tok-a") as a:
        holders = [Trickle(b, k, 256 * MiB) for k in keys(2, seed=301)]   # b's 2 streams, held
        attacks: list[Trickle] = []
        try:
            assert wait_until(lambda: b.stats()[1]["held.streams"] == 2, timeout=15)
            for i, k in enumerate(keys(2 * MAX_RPCS, seed=302)):
                t = Trickle(ro if i % 2 else b, k, 64 * KiB)
                attacks.append(t)
                assert wait_until(lambda: t.code is not None, timeout=30)
            assert all(t.while_sending for t in attacks)
            codes = [t.code for t in attacks]
            assert codes == [Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED] * MAX_RPCS
            assert all(h.code is None for h in holders)                       # still held
            for k in mine:                                                    # a is served
                assert a.put_stream(k, objects.make(k, 256 * KiB)) == pb.PUT_OUTCOME_STORED
            assert a.hello().tenant == "a"
        finally:
            for t in (*attacks, *holders):
                t.stop()
    assert grown(before, refused(store.target, "tok-b")) == {"streams": MAX_RPCS, "permission": MAX_RPCS,
                                                           "host_bytes": 2}   # the holders: no room
    assert wait_until(lambda: quiet(store.target), timeout=30)


def test_a_read_only_token_cannot_take_the_ticket_table(store):
    """b's read-only token mints OpenData tickets and never uses them: it is refused at its
    own ticket budget (counted), and a still gets tickets and opens data connections."""
    before = refused(store.target, "tok-b-ro")
    minted, code = 0, Code.OK
    with StoreClient(store.target, "tok-b-ro") as ro:
        while minted < 5000:
            code = rpc_code(lambda: ro.call("OpenData", pb.OpenDataRequest()))
            if code is not Code.OK:
                break
            minted += 1
        assert code is Code.RESOURCE_EXHAUSTED
        assert rpc_code(lambda: ro.call("OpenData", pb.OpenDataRequest())) is Code.RESOURCE_EXHAUSTED
    assert minted == 64                                         # b's default ticket budget
    assert grown(before, refused(store.target, "tok-b-ro")) == {"tickets": 2}
    with StoreClient(store.target, "tok-a") as a:
        for _ in range(3):
            ticket, port = ticket_of(a)
            with RawData(port) as raw:
                assert raw.hello(ticket, "tok-a")[0].code == 0
