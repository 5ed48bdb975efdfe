"""The client's lease release queue (``kvstore.client.leases.ReleaseQueue``) on a fake clock,
sending into a real in-process ``ServerStore`` (its ``release_leases``, as the servicer
calls it): nothing goes before the delay, a call's worth goes at once, batches never exceed
the limit, ``flush`` waits for what is in flight, and a release that fails is left to the
server's reaper.  Also ``LeaseWindow``'s deadline, as a table.
"""

import asyncio
import heapq
import itertools
import logging

import pytest

from kvstore.client.leases import LeaseWindow, ReleaseQueue
from kvstore.errors import TierUnavailableError
from tests.kits.server_core import LEASE_TTL, FakeClock, gauges, keys, make_store, put, scoped
from tiers.base import PutResult

DELAY = 0.02


class FakeTimers(FakeClock):
    """The event loop's ``call_later`` on a fake clock (and that clock, for the store).  A
    timer that comes due is handed to the real loop, so its callback runs on a later loop
    iteration, as a real timer's does, and not if it is cancelled before that."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = itertools.count()

    def call_later(self, delay: float, callback) -> "_Timer":
        timer = _Timer(callback)
        heapq.heappush(self._heap, (self.now + delay, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        while self._heap and self._heap[0][0] <= self.now:
            asyncio.get_running_loop().call_soon(heapq.heappop(self._heap)[2].fire)

    @property
    def armed(self) -> int:
        return sum(not t.cancelled for _, _, t in self._heap)


class _Timer:
    def __init__(self, callback) -> None:
        self.callback, self.cancelled = callback, False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.callback()


class Server:
    """A real store with ``n`` leased objects; ``send`` is the client's ReleaseLease."""

    def __init__(self, timers: FakeTimers) -> None:
        self.store, _ = make_store(timers, slots=8)
        self.calls: list[list[int]] = []
        self.answers: list[list[bool]] = []
        self.down = False

    async def lease(self, n: int) -> list[int]:
        ids = []
        for key in keys(n):
            assert await put(self.store, key) is PutResult.STORED
            ids.append((await self.store.lease(scoped(key), "a", LEASE_TTL)).lease_id)
        return ids

    async def send(self, ids: list[int]) -> list[bool]:
        self.calls.append(list(ids))
        await asyncio.sleep(0)  # the round trip: answered on a later loop iteration
        if self.down:
            raise TierUnavailableError("store unreachable")
        self.answers.append(self.store.release_leases(ids, "a"))
        return self.answers[-1]

    @property
    def held(self) -> int:
        return gauges(self.store)["leases"]


@pytest.fixture
def timers():
    return FakeTimers()


@pytest.fixture
async def server(timers):
    server = Server(timers)
    yield server
    await server.store.aclose()


async def spin(n: int = 10) -> None:
    """Let the loop run what is ready (tasks started by the queue, their round trips)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_releases_wait_for_the_delay_then_go_as_one_call(timers, server):
    ids = await server.lease(4)
    queue = ReleaseQueue(server.send, lambda: 8, DELAY, timers)
    for lease_id in ids:
        queue.add(lease_id)
    timers.advance(DELAY - 0.001)
    await spin()
    assert (server.calls, server.held, len(queue)) == ([], 4, 4)  # queued: still pinned
    timers.advance(0.001)
    await spin()
    assert server.calls == [ids] and server.answers == [[True] * 4]
    assert server.held == 0 and gauges(server.store)["refs"] == 0 and len(queue) == 0


async def test_a_calls_worth_goes_at_once_and_the_rest_waits(timers, server):
    ids = await server.lease(4)
    queue = ReleaseQueue(server.send, lambda: 3, DELAY, timers)
    for lease_id in ids:
        queue.add(lease_id)
    await spin()
    assert server.calls == [ids[:3]] and server.held == 1  # no delay for a full call
    assert timers.armed == 1  # the fourth waits
    timers.advance(DELAY)
    await spin()
    assert server.calls == [ids[:3], ids[3:]] and server.held == 0


async def test_batches_never_exceed_the_limit_read_at_send_time(timers, server):
    ids = await server.lease(7)
    limit = [100]
    queue = ReleaseQueue(server.send, lambda: limit[0], DELAY, timers)
    for lease_id in ids:
        queue.add(lease_id)
    limit[0] = 3  # a smaller server, say
    await queue.flush()
    assert server.calls == [ids[:3], ids[3:6], ids[6:]] and server.held == 0


async def test_flush_sends_at_once_cancels_the_timer_and_waits_for_the_answers(timers, server):
    ids = await server.lease(2)
    queue = ReleaseQueue(server.send, lambda: 8, DELAY, timers)
    queue.add(ids[0])
    assert timers.armed == 1
    await queue.flush()
    assert server.answers == [[True]] and timers.armed == 0  # answered before flush returned
    timers.advance(DELAY)
    await spin()
    assert server.calls == [[ids[0]]]  # no second, empty call
    queue.add(ids[1])  # a new batch, a new timer
    timers.advance(DELAY)
    await spin()
    assert server.calls == [[ids[0]], [ids[1]]] and server.held == 0


async def test_flush_waits_for_a_send_already_in_flight(timers, server):
    (lease_id,) = await server.lease(1)
    gate = asyncio.Event()

    async def slow_send(ids):
        await gate.wait()
        return await server.send(ids)

    queue = ReleaseQueue(slow_send, lambda: 1, DELAY, timers)
    queue.add(lease_id)  # a call's worth: in flight
    flushing = asyncio.ensure_future(queue.flush())
    await spin()
    assert not flushing.done() and server.held == 1
    gate.set()
    async with asyncio.timeout(5):
        await flushing
    assert server.answers == [[True]] and server.held == 0


async def test_a_failed_release_is_dropped_and_the_servers_reaper_takes_the_leases(timers, server, caplog):
    ids = await server.lease(3)
    queue = ReleaseQueue(server.send, lambda: 8, DELAY, timers)
    server.down = True
    caplog.set_level(logging.DEBUG, "kvstore.client.store_client")
    for lease_id in ids[:2]:
        queue.add(lease_id)
    await queue.flush()  # no error reaches the reader
    assert len(server.calls) == 1 and server.held == 3 and len(queue) == 0
    assert "releasing 2 leases failed (they expire)" in caplog.text
    server.down = False
    queue.add(ids[2])  # the queue goes on
    timers.advance(DELAY)
    await spin()
    assert server.answers == [[True]] and server.held == 2
    timers.advance(LEASE_TTL)
    server.store.reap()
    assert server.held == 0 and gauges(server.store)["refs"] == 0  # the pins went with them


# --- LeaseWindow ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "start,ttl,now,holds",
    [
        (10.0, 1.0, 10.0, True),
        (10.0, 1.0, 10.948, True),  # 1 s less 5 %, less 1 ms: the window ends at 10.949
        (10.0, 1.0, 10.949, False),
        (10.0, 1.0, 10.999, False),  # inside the server's TTL, outside the client's window
        (10.0, 0.002, 10.0008, True),  # a 2 ms lease: a 0.9 ms window
        (10.0, 0.002, 10.0009, False),
        (10.0, 0.0, 10.0, False),
    ],
)
def test_a_lease_window_ends_a_margin_before_the_ttl(start, ttl, now, holds):
    assert LeaseWindow(7, start, ttl).holds(now) is holds


def test_a_renewal_restarts_the_window_from_when_it_was_sent():
    window = LeaseWindow(7, 10.0, 1.0)
    window.renewed(sent_at=10.5, ttl_ms=2000)
    assert (window.start, window.ttl_s) == (10.5, 2.0)
    assert window.holds(12.399) and not window.holds(12.4)
