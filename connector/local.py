"""Worker halves living in this process, for the scheduler half's work at exit.

In vLLM's single-process mode the scheduler and worker halves share one process.  When the
interpreter exits after the last ``LLM.generate``, no engine step will carry the saves that
``request_finished`` planned (the blocks of the request's answer); the scheduler half hands
them to the worker half attached to the same host pool, which gathers and seals them at
once, and the usual commit at exit (``connector.saves.SavePlanner.adopt``) takes them.  In
the multi-process mode no worker half is local: the engine core runs one more step, which
carries them.  Weak references only: registering never keeps a worker alive.
"""

from __future__ import annotations

import threading
import weakref

_LOCK = threading.Lock()  # guards _WORKERS
_WORKERS: weakref.WeakSet = weakref.WeakSet()


def register(worker) -> None:
    with _LOCK:
        _WORKERS.add(worker)


def worker_on(pool_path: str):
    """A live worker half of this process attached to the pool at ``pool_path``, or None."""
    with _LOCK:
        return next((w for w in _WORKERS if w.pool_path == pool_path), None)
