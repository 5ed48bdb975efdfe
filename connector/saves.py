"""Save planning for the scheduler half (``connector.scheduler``): which objects of a request
to save in a step, their host reservations, and their commit.  Scheduler side; the worker
gathers into the reserved slots and reports back (``connector.plan``).

* **Full chunks** are saved as soon as the step that completes them has been scheduled.
* **The tail**: once the whole prompt is computed, the whole blocks of its last, partial
  chunk are saved as one *tail* object under their own key (``keys.chunk_hashes`` hashes a
  partial chunk with its own kind and length, so it never collides with a full chunk).  A
  repeat of the prompt then hits every whole block but the one holding its last token.
* **Keys still being written** (by an earlier request's save, or a promotion into the pool)
  are skipped, that chunk only: its writer publishes it.  Only a reservation that finds no
  room stops a request's saves, because its later chunks would be orphans.
* **Commit** happens when the worker reports the gather; a failed one frees the slot.
* **Shutdown** (``adopt``): no step will carry the worker's last reports, so each pending
  save whose slot already holds its sealed, verified object (the worker seals a header only
  after its gather completed) is committed and goes to the write-down.  A save whose slot
  does not verify by the deadline keeps its reservation: its copy may still be writing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from connector.ioloop import IOLoop
from connector.plan import ChunkCopy, SaveJob
from connector.requests import ReqState
from kvstore import codec
from kvstore.errors import ObjectFormatError
from kvstore.keys import ObjectKey
from kvstore.store.tiered import TieredStore
from tiers.base import PutHandle

log = logging.getLogger("kvstore.connector")


class SavePlanner:
    def __init__(self, store: TieredStore, io: IOLoop, chunk_size: int, block_size: int,
                 object_size: Callable[[int], int], tail_keys: Callable[[ReqState, int], list[ObjectKey]],
                 fail: Callable[[str, str], None]) -> None:
        self.store, self.host, self.io = store, store.host, io
        self.chunk_size, self.block_size = chunk_size, block_size
        self.pages_per_chunk = chunk_size // block_size
        self.object_size = object_size  # pages per layer -> object bytes
        self.tail_keys = tail_keys      # (request, chunk index) -> tail keys, longest first
        self._fail = fail
        self.jobs: dict[int, list[tuple[PutHandle, ObjectKey]]] = {}
        self.in_flight: dict[ObjectKey, int] = {}  # key -> save job reserving its slot
        self.committed = 0

    # --- planning ------------------------------------------------------------------------------

    def plan(self, st: ReqState, done: int, job_id: int) -> SaveJob | None:
        """The save job for request ``st`` once ``done`` of its prompt tokens are computed."""
        wanted = self._wanted(st, done)
        if not wanted:
            return None
        present = self.io.run(self.store.present([key for _, key, _, _ in wanted]))
        chunks, handles = [], []
        for (index, key, parent, pages), there in zip(wanted, present):
            if not there and key not in self.in_flight:
                handle = self._reserve(key, pages, parent)
                if handle is None:
                    if not self.host.writing_sync(key):  # no room: later chunks would be orphans
                        st.save_stopped = True
                        break
                else:
                    blocks = st.blocks[index * self.pages_per_chunk:][:pages]
                    chunks.append(ChunkCopy(handle.offset, bytes(key), blocks,
                                            parent=bytes(st.hashes[index - 1]) if index else b"", pages=pages))
                    handles.append((handle, key))
            if pages == self.pages_per_chunk:
                st.saved_upto = index + 1
            else:
                st.tail_done = True
        if not chunks:
            return None
        self.jobs[job_id] = handles
        self.in_flight.update(dict.fromkeys((k for _, k in handles), job_id))
        st.had_saves = True
        return SaveJob(job_id, st.view.req_id, chunks, self.chunk_size)

    def _wanted(self, st: ReqState, done: int) -> list[tuple[int, ObjectKey, ObjectKey | None, int]]:
        """(chunk index, key, parent key, pages) of the objects ``done`` tokens complete."""
        if st.save_stopped:
            return []
        c, ppc = self.chunk_size, self.pages_per_chunk
        out = [(i, st.keys[i], st.keys[i - 1] if i else None, ppc)
               for i in range(st.saved_upto, min(done // c, len(st.keys)))]
        prompt = len(st.view.prompt)
        last = len(st.keys)  # the partial chunk's index
        if done >= prompt and not st.tail_done and (prompt - last * c) // self.block_size >= 1:
            keys = self.tail_keys(st, last)
            pages = (prompt - last * c) // self.block_size
            if keys and len(keys) >= pages:
                out.append((last, keys[len(keys) - pages], st.keys[last - 1] if last else None, pages))
        return out

    def _reserve(self, key: ObjectKey, pages: int, parent: ObjectKey | None) -> PutHandle | None:
        try:
            return self.host.put_start_sync(key, self.object_size(pages), parent)
        except Exception as err:  # noqa: BLE001 - a full or closed pool skips the save
            self._fail("host", f"reserve:{type(err).__name__}")
            return None

    # --- outcomes ------------------------------------------------------------------------------

    def report(self, job_id: int, oks: list[bool]) -> None:
        """The worker's outcome of each object of ``job_id``."""
        for (handle, key), ok in zip(self.jobs.pop(job_id, []), oks):
            self.in_flight.pop(key, None)
            self._commit(handle, key, ok)

    def _commit(self, handle: PutHandle, key: ObjectKey, ok: bool) -> None:
        if not self.host.put_commit_sync(handle, ok):
            self._fail("host", "save")
            return
        self.committed += 1
        self.store.written(key, handle.parent)

    def adopt(self, timeout: float) -> int:
        """At shutdown: commit every pending save whose slot verifies (module docstring);
        wait up to ``timeout`` s for the others.  Returns how many were committed."""
        deadline, adopted = time.monotonic() + timeout, 0
        while self.jobs:
            for job_id in list(self.jobs):
                left = []
                for handle, key in self.jobs[job_id]:
                    if _sealed(handle, key):
                        self.in_flight.pop(key, None)
                        self._commit(handle, key, True)
                        adopted += 1
                    else:
                        left.append((handle, key))
                if left:
                    self.jobs[job_id] = left
                else:
                    del self.jobs[job_id]
            if not self.jobs or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        if self.jobs:
            log.warning("kvstore: %d saves still unsealed at shutdown are left out",
                        sum(len(h) for h in self.jobs.values()))
        return adopted


def _sealed(handle: PutHandle, key: ObjectKey) -> bool:
    try:
        codec.verify(handle.buffer, expected_key=key, length=handle.size)
    except ObjectFormatError:
        return False
    return True


__all__ = ["SavePlanner"]
