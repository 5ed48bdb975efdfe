"""tiers.breaker.CircuitBreaker: open on a transport failure, fail fast, one background probe,
close when the probe succeeds.  The probe is a plain coroutine the test controls."""

from __future__ import annotations

import asyncio

import pytest

from tiers.breaker import CircuitBreaker


class Backend:
    """The probe target: down until ``up`` is set; counts and times its probes."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0
        self.inside = 0
        self.max_inside = 0
        self.gate: asyncio.Event | None = None  # when set, probes wait for it

    async def probe(self) -> None:
        self.calls += 1
        self.inside += 1
        self.max_inside = max(self.max_inside, self.inside)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if not self.up:
                raise ConnectionRefusedError("backend down")
        finally:
            self.inside -= 1


async def wait_until(cond, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def test_retry_interval_must_be_positive():
    with pytest.raises(ValueError, match="retry_s must be positive"):
        CircuitBreaker("x", Backend().probe, retry_s=0)


async def test_closed_breaker_allows_and_counts_nothing():
    b = CircuitBreaker("x", Backend().probe, retry_s=0.01)
    assert b.allow() and b.allow()
    assert b.stats() == {
        "breaker_open": 0.0,
        "breaker_opened": 0,
        "breaker_closed": 0,
        "breaker_rejected": 0,
        "breaker_probes": 0,
        "breaker_failures": 0,
    }
    await b.aclose()


async def test_failure_opens_once_and_rejects_fast():
    backend = Backend()
    b = CircuitBreaker("x", backend.probe, retry_s=10.0)
    b.failure(ConnectionResetError("reset by peer"))
    b.failure(TimeoutError("slow"))  # already open: counted, not re-opened
    assert b.is_open
    assert [b.allow() for _ in range(5)] == [False] * 5
    s = b.stats()
    assert (s["breaker_open"], s["breaker_opened"], s["breaker_failures"], s["breaker_rejected"]) == (1.0, 1, 2, 5)
    assert b.last_error == "TimeoutError: slow"
    assert backend.calls == 0  # retry_s has not passed: no probe yet
    await b.aclose()


async def test_probe_retries_until_backend_is_back_then_closes():
    backend = Backend()
    b = CircuitBreaker("x", backend.probe, retry_s=0.01)
    b.failure(ConnectionRefusedError("refused"))
    await wait_until(lambda: backend.calls >= 3)
    assert b.is_open and not b.allow()
    assert "backend down" in b.last_error
    backend.up = True
    await wait_until(lambda: not b.is_open)
    assert b.allow()
    s = b.stats()
    assert (s["breaker_opened"], s["breaker_closed"]) == (1, 1)
    assert s["breaker_probes"] == backend.calls >= 4
    calls = backend.calls
    await asyncio.sleep(0.05)
    assert backend.calls == calls  # closed: the probe loop has ended
    await b.aclose()


async def test_success_closes_without_waiting_for_the_probe():
    backend = Backend()
    b = CircuitBreaker("x", backend.probe, retry_s=10.0)
    b.failure(OSError("down"))
    b.success()
    assert not b.is_open and b.allow()
    assert b.stats()["breaker_closed"] == 1
    b.success()  # closing a closed breaker is a no-op
    assert b.stats()["breaker_closed"] == 1
    await b.aclose()


async def test_reopening_while_a_probe_loop_lives_keeps_one_probe_loop():
    """close + re-open while the first probe loop still sleeps must not start a second one."""
    backend = Backend()
    backend.gate = asyncio.Event()
    b = CircuitBreaker("x", backend.probe, retry_s=0.005)
    b.failure(OSError("down"))
    b.success()
    b.failure(OSError("down again"))
    await wait_until(lambda: backend.inside >= 1)
    await asyncio.sleep(0.05)  # ten retry intervals: a second loop would have entered by now
    assert backend.max_inside == 1
    backend.up = True
    backend.gate.set()
    await wait_until(lambda: not b.is_open)
    s = b.stats()
    assert (s["breaker_opened"], s["breaker_closed"]) == (2, 2)
    await b.aclose()


async def test_probe_finishing_after_an_explicit_close_does_not_count_a_second_close():
    backend = Backend()
    backend.gate = asyncio.Event()
    backend.up = True
    b = CircuitBreaker("x", backend.probe, retry_s=0.005)
    b.failure(OSError("down"))
    await wait_until(lambda: backend.inside == 1)
    b.success()  # closed while the probe is in flight
    backend.gate.set()
    await wait_until(lambda: backend.inside == 0)
    await asyncio.sleep(0.02)
    assert b.stats()["breaker_closed"] == 1
    await b.aclose()


def test_opened_outside_a_loop_is_probed_from_the_first_allow_inside_one():
    backend = Backend()
    backend.up = True
    b = CircuitBreaker("x", backend.probe, retry_s=0.005)
    b.failure(OSError("down"))  # no running loop here: nobody can probe yet

    async def inside() -> None:
        assert not b.allow()  # starts the probe
        await wait_until(lambda: not b.is_open)
        assert b.allow()
        await b.aclose()

    asyncio.run(inside())
    assert backend.calls == 1


async def test_aclose_stops_the_probe_and_no_probe_starts_after_it():
    backend = Backend()
    b = CircuitBreaker("x", backend.probe, retry_s=0.005)
    b.failure(OSError("down"))
    await wait_until(lambda: backend.calls >= 1)
    await b.aclose()
    calls = backend.calls
    b.failure(OSError("still down"))
    assert not b.allow()
    await asyncio.sleep(0.03)
    assert backend.calls == calls
    assert b.is_open


async def test_probe_cancellation_is_not_swallowed():
    backend = Backend()
    backend.gate = asyncio.Event()
    b = CircuitBreaker("x", backend.probe, retry_s=0.005)
    b.failure(OSError("down"))
    await wait_until(lambda: backend.inside == 1)
    await b.aclose()  # cancels the probe mid-call; must return, not hang or raise
    assert backend.inside == 0
    assert b.is_open
