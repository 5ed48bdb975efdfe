"""A copy device with CUDA's side-stream semantics, on the CPU (``device: emulated-cuda``).

``HostDevice`` is kind: its events complete through a callback right after the copy ran.
A real CUDA side stream is not, and code that was only ever run against the kind device
hides every bug of the CUDA path.  This device is at least as unforgiving as the GPU:

* ``submit(job)`` runs the job's Python code at once on the caller's thread, as
  ``CudaDevice`` does, but every tensor write the job issues (``copy_``, ``index_copy_``,
  ``index_select(out=)``, any op that mutates a tensor) is only *enqueued*.  A stream
  thread performs the writes later, in submission order, after ``delay`` seconds per job.
  So when ``submit`` returns, a "device-to-host" copy has not landed: host code that reads
  the destination (a checksum, say) sees the old bytes, exactly as with a ``non_blocking``
  D2H copy on a GPU.  Blocking copies are deferred too (stricter than CUDA).
* An event is reached when the stream gets to it, and **nothing calls back**: completion,
  and the callbacks, happen only on the thread that observes it through ``query()``,
  ``wait()`` or ``synchronize()``, as with ``torch.cuda.Event``.
* ``make_compute_wait`` blocks the caller until the stream reached the event, which
  stands in for the compute stream's wait; like ``wait_event`` it observes nothing, so a
  copy's error is learnt only by a later ``query``/``wait``/``synchronize``.
* ``fail(n)`` makes the n-th job's copies fail on the stream (a stream error, reported
  through its event when observed).

Tensor reads inside a job run eagerly (``index_select`` into a temporary, say); that is
what CUDA does for inputs the compute stream has finished writing.  The deferred writes run
under the grad and inference modes of their ``submit`` (a CUDA kernel is dispatched at
submit time, under the caller's modes; vLLM's forward runs in ``torch.inference_mode``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from connector.copies import CopyEvent, Job, StreamCopyEvent
from connector.copy_thread import CopyThread

Op = tuple[Callable[..., object], tuple, dict]  # a deferred tensor write: func, args, kwargs


class _DeferWrites(TorchDispatchMode):
    """Record every tensor-mutating op instead of running it; reads run as usual.
    Dispatch modes are per thread: other threads' tensor work is untouched."""

    def __init__(self, ops: list[Op]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if not schema.is_mutable:
            return func(*args, **kwargs)
        written = _written(schema, args, kwargs)
        if len(written) != len(schema.returns):
            raise NotImplementedError(f"emulated-cuda: cannot defer {func} (its results are not its outputs)")
        self.ops.append((func, args, kwargs))
        return written[0] if len(written) == 1 else tuple(written)


def _written(schema, args: tuple, kwargs: dict) -> list:
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs[arg.name])
    return out


class EmulatedCudaEvent(StreamCopyEvent):
    __slots__ = ("_reach", "_err")

    def __init__(self) -> None:
        super().__init__()
        self._reach = threading.Event()
        self._err: BaseException | None = None

    def _reached(self) -> bool:
        return self._reach.is_set()

    def _wait_reached(self, timeout: float | None) -> bool:
        return self._reach.wait(timeout)

    def _stream_error(self) -> BaseException | None:
        return self._err


Pending = tuple[int, list[Op], tuple[bool, bool], EmulatedCudaEvent]  # job number, writes, modes, event


class EmulatedCudaDevice:
    name = "emulated-cuda"

    def __init__(self, delay: float = 0.002, fail: Callable[[int], bool] | None = None) -> None:
        self.delay, self.fail = delay, fail
        self.failures = 0  # jobs whose copies failed on the stream (injected)
        self.deferred_writes = 0  # tensor writes that ran on the stream
        self._count = 0
        self._lock = threading.Lock()  # guards _events
        self._events: list[EmulatedCudaEvent] = []  # submitted, not yet observed
        self._stream: CopyThread[Pending] = CopyThread("kvstore-emulated-stream", self._run)

    def submit(self, job: Job) -> CopyEvent:
        self._stream.check_open()
        n, self._count = self._count, self._count + 1
        ops: list[Op] = []
        error = None
        with _DeferWrites(ops):
            try:
                job()
            except Exception as err:  # noqa: BLE001 - reported through the event
                error = err
        event = EmulatedCudaEvent()
        self._stream.begin()
        with self._lock:
            self._events = [e for e in self._events if not e.done]
            self._events.append(event)
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._stream.put((n, ops, modes, event))
        if error is not None:
            # The writes the job enqueued before it raised may still touch its buffers.
            event._reach.wait()
            event.complete(error)
        return event

    def _run(self, item: Pending) -> None:
        """One job's deferred writes, on the stream thread."""
        n, ops, (inference, grad), event = item
        if self.delay:
            time.sleep(self.delay)
        try:
            if self.fail is not None and self.fail(n):
                self.failures += 1
                raise OSError(f"injected stream failure in job {n}")
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                for func, args, kwargs in ops:
                    func(*args, **kwargs)
                    self.deferred_writes += 1
        except BaseException as err:  # noqa: BLE001 - a stream error, seen via the event
            event._err = err
        event._reach.set()  # reached; nothing calls back
        self._stream.finished()

    def make_compute_wait(self, event: CopyEvent, timeout: float | None = None) -> bool:
        if isinstance(event, EmulatedCudaEvent):
            return event._reach.wait(timeout)
        return event.wait(timeout)

    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait until the stream ran everything, then complete every event (oldest first)."""
        if not self._stream.wait_idle(timeout):
            return False
        with self._lock:
            events, self._events = self._events, []
        for e in events:
            e.query()
        return True

    def close(self, timeout: float = 60.0) -> None:
        self._stream.close(timeout, drain=self.synchronize)  # every event completed first
