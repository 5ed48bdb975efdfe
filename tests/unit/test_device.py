"""Copy engines (docs/architecture.md#copy-engines): the host device, its faulty test double, and a lifecycle story.

The story: copies run in submission order on one dedicated thread and report through their
event, never by raising in the caller; a ``FaultyDevice`` delays, fails or reorders those
completions; and a cancelled load ticket refuses release, keeping its staging buffer alive,
until the copy writing that buffer has signalled completion.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from connector.device import CopyEvent, FaultyDevice, HostDevice, make_device
from kvstore.errors import ConfigError
from kvstore.lifecycle import LoadState, load_ticket

WAIT = 5.0  # generous upper bound for anything that should happen "soon"


def shut(device: HostDevice) -> None:
    """Close after a bounded drain: a completion held forever fails the test, not hangs it."""
    assert device.synchronize(WAIT), "copies still pending at teardown"
    device.close()


@pytest.fixture
def host():
    device = HostDevice()
    yield device
    shut(device)


def gated_job(gate: threading.Event, log: list, tag):
    """A job that blocks until ``gate`` opens, then records ``tag``."""

    def job():
        assert gate.wait(WAIT), "test gate never opened"
        log.append(tag)

    return job


# ---- HostDevice ----------------------------------------------------------------------------


def test_jobs_run_in_submission_order_on_one_thread_that_is_not_the_callers(host):
    ran: list[tuple[int, int]] = []
    events = [host.submit(lambda i=i: ran.append((i, threading.get_ident()))) for i in range(20)]
    assert host.synchronize(WAIT)
    assert [i for i, _ in ran] == list(range(20))
    threads = {tid for _, tid in ran}
    assert len(threads) == 1
    assert threading.get_ident() not in threads
    assert all(e.ok for e in events)


def test_event_completes_only_after_its_job_has_finished(host):
    gate, log = threading.Event(), []
    seen_in_callback: list[list] = []
    event = host.submit(gated_job(gate, log, "copied"))
    event.on_complete(lambda e: seen_in_callback.append(list(log)))
    assert not event.wait(0.05)
    assert not event.query() and not event.ok and seen_in_callback == []
    gate.set()
    assert event.wait(WAIT)
    assert event.ok and event.error is None and log == ["copied"]
    assert host.synchronize(WAIT)
    assert seen_in_callback == [["copied"]]  # the callback already saw the job's effect


def test_a_failing_job_reports_through_its_event_and_the_device_keeps_going(host):
    def broken():
        raise ValueError("torn page")

    event = host.submit(broken)  # does not raise here
    after = host.submit(lambda: None)
    assert event.wait(WAIT) and after.wait(WAIT)
    assert isinstance(event.error, ValueError) and str(event.error) == "torn page"
    assert not event.ok
    assert after.ok


def test_on_complete_runs_each_callback_exactly_once(host):
    gate, calls = threading.Event(), []
    event = host.submit(gated_job(gate, [], None))
    event.on_complete(lambda e: calls.append(("before", threading.get_ident())))
    gate.set()
    assert host.synchronize(WAIT)
    event.complete(RuntimeError("late duplicate"))  # a second completion changes nothing
    assert event.ok
    event.on_complete(lambda e: calls.append(("after", threading.get_ident())))
    assert [tag for tag, _ in calls] == ["before", "after"]
    assert calls[0][1] != threading.get_ident()  # fired on the copy thread
    assert calls[1][1] == threading.get_ident()  # already complete: runs at once, here


def test_synchronize_waits_for_every_submitted_job(host):
    done: list[int] = []

    def slow(i):
        time.sleep(0.02)
        done.append(i)

    events = [host.submit(lambda i=i: slow(i)) for i in range(5)]
    assert host.synchronize(WAIT)
    assert done == [0, 1, 2, 3, 4]
    assert all(e.query() for e in events)


def test_synchronize_times_out_while_a_job_is_still_running(host):
    gate = threading.Event()
    event = host.submit(gated_job(gate, [], None))
    assert host.synchronize(0.05) is False
    gate.set()
    assert host.synchronize(WAIT) is True and event.ok


def test_close_drains_is_idempotent_and_refuses_new_work():
    device, ran = HostDevice(), []
    device.submit(lambda: (time.sleep(0.05), ran.append(1)))
    device.close()
    assert ran == [1]  # close waited for the pending copy
    device.close()
    with pytest.raises(RuntimeError, match="closed"):
        device.submit(lambda: None)


# ---- FaultyDevice --------------------------------------------------------------------------


def test_faulty_delay_holds_back_completion():
    device = FaultyDevice(delay=0.2)
    try:
        start = time.monotonic()
        event = device.submit(lambda: None)
        assert not event.wait(0.05)
        assert event.wait(WAIT) and event.ok
        assert time.monotonic() - start >= 0.2
    finally:
        shut(device)


def test_faulty_fail_fails_exactly_the_chosen_job():
    device, ran = FaultyDevice(fail=lambda n: n == 1), []
    try:
        events = [device.submit(lambda i=i: ran.append(i)) for i in range(3)]
        assert device.synchronize(WAIT)
    finally:
        shut(device)
    assert [e.ok for e in events] == [True, False, True]
    assert isinstance(events[1].error, OSError)
    assert ran == [0, 2]  # the failed job never copied
    assert device.failures == 1


@pytest.mark.parametrize("reorder, expected", [(False, [0, 1]), (True, [1, 0])])
def test_faulty_reorder_signals_two_consecutive_completions_in_reverse(reorder, expected):
    device = FaultyDevice(reorder=reorder)
    gate, ran, fired = threading.Event(), [], []
    try:
        # Job 1 is queued before job 0 may finish, so there is a neighbour to swap with.
        first = device.submit(gated_job(gate, ran, 0))
        second = device.submit(lambda: ran.append(1))
        first.on_complete(lambda e: fired.append(0))
        second.on_complete(lambda e: fired.append(1))
        gate.set()
        assert device.synchronize(WAIT)
    finally:
        shut(device)
    assert ran == [0, 1]  # the copies themselves ran in order
    assert fired == expected
    assert first.ok and second.ok


def test_faulty_reorder_does_not_hold_a_lone_completion_forever():
    device = FaultyDevice(reorder=True)
    try:
        event = device.submit(lambda: None)
        assert event.wait(WAIT) and event.ok
    finally:
        shut(device)


# ---- the lifecycle story -------------------------------------------------------------------


def test_cancelled_load_keeps_its_staging_buffer_until_the_copy_has_finished():
    source = np.arange(1, 65, dtype=np.uint8)
    staging = np.zeros_like(source)  # the staging slot the copy writes into
    freed: list[np.ndarray] = []  # what the slot held when it was handed back

    def free_slot(ticket):
        freed.append(staging.copy())
        staging[:] = 0xEE  # a reused slot: anything still copying would be corrupted

    device = FaultyDevice(delay=0.2)
    try:
        ticket = load_ticket("chunk-7", on_release=free_slot)
        ticket.advance(LoadState.READABLE)
        ticket.begin_copy()
        event = device.submit(lambda: np.copyto(staging, source))
        event.on_complete(lambda e: ticket.end_copy())

        ticket.cancel("request aborted")
        assert ticket.state is LoadState.CANCELLED
        assert ticket.inflight == 1
        assert ticket.release() is False
        assert freed == [] and ticket.state is LoadState.CANCELLED

        assert device.synchronize(WAIT)  # also waits for the end_copy callback
        assert event.ok and ticket.drained
        assert ticket.release() is True
        assert ticket.state is LoadState.RELEASED
        assert len(freed) == 1 and np.array_equal(freed[0], source)  # copy landed first
        assert ticket.release() is True and len(freed) == 1  # on_release ran once
    finally:
        shut(device)


# ---- make_device ---------------------------------------------------------------------------


def test_make_device_host_is_a_host_device():
    device = make_device("host")
    try:
        assert isinstance(device, HostDevice) and device.name == "host"
        assert isinstance(device.submit(lambda: None), CopyEvent)
    finally:
        shut(device)


def test_make_device_rejects_an_unknown_kind():
    with pytest.raises(ConfigError, match="bogus"):
        make_device("bogus")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_make_device_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="CUDA"):
        make_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_make_device_auto_without_cuda_is_host():
    device = make_device("auto")
    try:
        assert isinstance(device, HostDevice)
    finally:
        shut(device)
