"""The ``emulated-cuda`` copy device: CUDA's side-stream semantics on the CPU.

The story: a job's Python code runs at ``submit``, but its tensor writes land only when
the stream thread reaches them; an event is reached silently and completes (running its
callbacks on the observer's thread) only through ``query``/``wait``/``synchronize``;
``make_compute_wait`` blocks until the stream reached it without observing it; errors in
the job, on the stream or in a callback are reported through the event and never wedge the
stream.  Also: host-device callbacks that raise do not kill the copy thread.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from connector.config import ConnectorConfig
from connector.device import HostDevice, make_device
from connector.emulated_cuda import EmulatedCudaDevice
from kvstore.errors import ConfigError

WAIT = 5.0


@pytest.fixture
def stream():
    dev = EmulatedCudaDevice(delay=0.05)
    yield dev
    assert dev.synchronize(WAIT)
    dev.close()


def test_a_non_blocking_copy_has_not_landed_when_submit_returns(stream):
    src, dst = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)
    seen_in_job: list[float] = []

    def job():
        dst.copy_(src, non_blocking=True)
        seen_in_job.append(float(dst.sum()))  # host code right after the copy: old bytes

    event = stream.submit(job)
    assert seen_in_job == [0.0]
    assert float(dst.sum()) == 0.0  # not landed after submit either
    assert event.wait(WAIT) and event.ok
    assert torch.equal(dst, src)
    assert stream.deferred_writes == 1


def test_every_kind_of_tensor_write_is_deferred_and_runs_in_order(stream):
    pages = torch.zeros(8, 4)
    src = torch.arange(32, dtype=torch.float32).view(8, 4)
    idx = torch.tensor([1, 5])
    out = torch.zeros(2, 4)

    def job():
        pages[2:4].copy_(src[2:4])  # slice copy
        pages.index_copy_(0, idx, src[[1, 5]])  # index_copy_
        torch.index_select(pages, 0, idx, out=out)  # out= (reads pages eagerly!)
        pages[2:4].mul_(0).add_(7)  # chained in-place writes

    stream.submit(job)
    assert torch.count_nonzero(pages) == 0 and torch.count_nonzero(out) == 0
    assert stream.synchronize(WAIT)
    assert torch.equal(pages[1], src[1]) and torch.equal(pages[5], src[5])
    assert torch.equal(pages[2:4], torch.full((2, 4), 7.0))  # in order: copy, then mul, add
    # out= read ``pages`` on the stream, after the writes before it in the same job
    assert torch.equal(out, torch.stack([src[1], src[5]]))


def test_nothing_calls_back_until_somebody_observes_the_event(stream):
    calls: list[int] = []
    event = stream.submit(lambda: None)
    event.on_complete(lambda e: calls.append(threading.get_ident()))
    time.sleep(0.3)  # the stream reached it long ago
    assert calls == [] and not event.done
    assert event.query()  # observing completes it, here
    assert calls == [threading.get_ident()]
    assert event.query() and len(calls) == 1


def test_query_is_false_until_the_stream_reached_the_event(stream):
    event = stream.submit(lambda: None)
    assert not event.query() and not event.ok
    assert not event.wait(0.01)
    assert event.wait(WAIT) and event.ok


def test_make_compute_wait_blocks_until_reached_but_observes_nothing(stream):
    calls: list[str] = []
    dst = torch.zeros(4)
    event = stream.submit(lambda: dst.copy_(torch.ones(4), non_blocking=True))
    event.on_complete(lambda e: calls.append("cb"))
    start = time.monotonic()
    assert stream.make_compute_wait(event, WAIT)
    assert time.monotonic() - start >= 0.04  # it really waited for the stream
    assert torch.equal(dst, torch.ones(4))  # "compute" now sees the copied bytes
    assert calls == [] and not event.done
    assert stream.make_compute_wait(stream.submit(lambda: None), 0.001) is False  # still queued


def test_synchronize_completes_every_event_oldest_first(stream):
    order: list[int] = []
    events = [stream.submit(lambda: None) for _ in range(4)]
    for i, e in enumerate(events):
        e.on_complete(lambda e, i=i: order.append(i))
    assert stream.synchronize(WAIT)
    assert order == [0, 1, 2, 3] and all(e.ok for e in events)


def test_synchronize_times_out_while_the_stream_is_behind():
    dev = EmulatedCudaDevice(delay=0.3)
    try:
        dev.submit(lambda: None)
        assert dev.synchronize(0.01) is False
        assert dev.synchronize(WAIT) is True
    finally:
        dev.close()


def test_a_job_that_raises_completes_with_its_error_after_its_enqueued_writes(stream):
    dst = torch.zeros(4)

    def job():
        dst.copy_(torch.ones(4))
        raise ValueError("bad block table")

    event = stream.submit(job)  # does not raise here
    assert event.done and isinstance(event.error, ValueError)
    assert torch.equal(dst, torch.ones(4))  # completed only once the enqueued write ran
    assert stream.submit(lambda: None).wait(WAIT)


def test_an_injected_stream_failure_is_seen_only_through_the_event():
    dev = EmulatedCudaDevice(delay=0.0, fail=lambda n: n == 1)
    try:
        dst = [torch.zeros(2) for _ in range(3)]
        events = [dev.submit(lambda d=d: d.copy_(torch.ones(2))) for d in dst]
        assert dev.synchronize(WAIT)
        assert [e.ok for e in events] == [True, False, True]
        assert isinstance(events[1].error, OSError) and dev.failures == 1
        assert torch.count_nonzero(dst[1]) == 0  # the failed job's copy never landed
        assert torch.equal(dst[2], torch.ones(2))  # and the stream kept going
    finally:
        dev.close()


def test_other_threads_tensor_writes_are_not_deferred(stream):
    other = torch.zeros(4)
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        assert release.wait(WAIT)

    worker = threading.Thread(target=lambda: stream.submit(job))
    worker.start()
    assert started.wait(WAIT)
    other.copy_(torch.ones(4))  # while a job is inside its deferral
    assert torch.equal(other, torch.ones(4))
    release.set()
    worker.join(WAIT)


@pytest.mark.parametrize("kind", ["host", "emulated-cuda"])
def test_a_raising_callback_is_counted_and_never_kills_the_copy_thread(kind):
    dev = HostDevice() if kind == "host" else EmulatedCudaDevice(delay=0.0)
    try:
        first = dev.submit(lambda: None)
        first.on_complete(lambda e: 1 / 0)
        first.on_complete(lambda e: None)
        assert first.wait(WAIT)
        assert isinstance(first.callback_error, ZeroDivisionError) and not first.ok
        dst = torch.zeros(2)
        later = dev.submit(lambda: dst.copy_(torch.ones(2)))
        assert later.wait(WAIT) and later.ok and torch.equal(dst, torch.ones(2))
    finally:
        dev.synchronize(WAIT)
        dev.close()


def test_close_refuses_new_work():
    dev = EmulatedCudaDevice()
    dev.close()
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.submit(lambda: None)


def test_make_device_and_config_accept_emulated_cuda_with_options():
    dev = make_device("emulated-cuda:delay=0.01,fail_every=2")
    try:
        assert isinstance(dev, EmulatedCudaDevice) and dev.delay == 0.01
        assert dev.fail(1) and not dev.fail(0)
    finally:
        dev.close()
    assert ConnectorConfig.from_extra_config({"device": "emulated-cuda"}, env={}).device == "emulated-cuda"
    env_cfg = ConnectorConfig.from_extra_config({}, env={"KVSTORE_DEVICE": "emulated-cuda:delay=0"})
    assert env_cfg.device == "emulated-cuda:delay=0"
    for bad in ("emulated-cuda:speed=2", "emulated-cuda:delay=-1", "emulated-cuda:delay=x", "gpu"):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra_config({"device": bad}, env={})


def test_deferred_writes_run_under_the_inference_mode_of_their_submit(stream):
    """vLLM runs the forward, and so the connector's hooks, in ``torch.inference_mode``;
    a KV cache made there is an inference tensor that only inference mode may write."""
    with torch.inference_mode():
        pages = torch.zeros(4, 8)
        event = stream.submit(lambda: pages[1:3].copy_(torch.ones(2, 8)))
    assert event.wait(WAIT) and event.ok, event.error
    assert torch.equal(pages[1:3], torch.ones(2, 8))
