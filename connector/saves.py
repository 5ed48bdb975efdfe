"""Save planning for the scheduler half (``connector.scheduler``): which objects of a request
to save in a step, their host reservations, and their commit.  Scheduler side; the worker
gathers into the reserved slots and reports back (``connector.plan``).

* **Full chunks** are saved as soon as the step that completes them has been scheduled,
  whether their tokens came from the prompt or were generated (a chat's next turn repeats
  the answer: it hits through it).  Each object's header says how many of its tokens were
  generated, so such hits are counted apart.
* **Tails**: once the whole prompt is computed, the whole blocks of its last, partial
  chunk are saved as one *tail* object under their own key (``keys.chunk_hashes`` hashes a
  partial chunk with its own kind and length, so it never collides with a full chunk).  A
  repeat of the prompt then hits every whole block but the one holding its last token.
  When the request ends, the whole blocks after its last full chunk (prompt and answer)
  are saved as its last tail.
* **Keys still being written** (by an earlier request's save, or a promotion into the pool)
  are skipped, that chunk only: its writer publishes it.  Only a reservation that finds no
  room stops a request's saves, because its later chunks would be orphans.
* **Commit** happens when the worker reports the gather; a failed one frees the slot.
* **Tensor parallelism**: every worker gathers its KV heads into the same slot, and the
  object is sealed here (header and checksum of the whole payload) once every worker
  reported its part (``geometry_of`` set); with one writer, the worker seals it.
* **Shutdown** (``adopt``): no step will carry the worker's last reports, so each pending
  save whose slot already holds its sealed, verified object (the worker seals a header only
  after its gather completed) is committed and goes to the write-down.  A save whose slot
  does not verify by the deadline keeps its reservation: its copy may still be writing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.hits import HitFinder, state_key
from connector.ioloop import IOLoop
from connector.plan import NULL_BLOCK, ChunkCopy, SaveJob
from connector.requests import ReqState
from kvstore import codec
from kvstore.errors import ObjectFormatError
from kvstore.keys import ROOT, ChunkHash, ObjectKey
from kvstore.layout import ChunkShape
from kvstore.store.tiered import TieredStore
from tiers.base import PutHandle

log = logging.getLogger("kvstore.connector")


@dataclass(slots=True)
class _Pending:
    """A reserved slot the workers are gathering into."""

    handle: PutHandle
    key: ObjectKey
    chunk: ChunkCopy


@dataclass(slots=True)
class _Wanted:
    """One object a save would write: chunk ``index``'s first ``pages`` pages."""

    index: int
    key: ObjectKey
    parent: ObjectKey | None
    pages: int
    generated: int
    prompt_tail: bool = False
    end: int = 0  # tails: the tokens they cover

    def done(self, st: ReqState) -> None:
        """Record that this object was saved, found, or skipped for the request."""
        if self.end == 0:
            st.saved_upto = self.index + 1
        elif self.prompt_tail:
            st.tail_done = True
        else:
            st.final_tail = self.end


def _generated(start: int, end: int, prompt: int) -> int:
    """Tokens of ``start..end`` past the prompt (they were generated)."""
    return max(0, end - max(start, prompt))


class SavePlanner:
    def __init__(
        self,
        store: TieredStore,
        io: IOLoop,
        shape: ChunkShape,
        object_size: Callable[[int], int],
        keys: HitFinder,
        fail: Callable[[str, str], None],
    ) -> None:
        self.store, self.host, self.io = store, store.host, io
        self.chunk_size, self.block_size = shape.chunk_size, shape.block_size
        self.pages_per_chunk = shape.pages
        self.object_size = object_size  # pages per layer -> object bytes
        self.keys = keys  # the request's chunk and tail keys
        self._fail = fail
        self.jobs: dict[int, list[_Pending]] = {}
        # Under tensor parallelism the workers each write a part of an object and the
        # scheduler seals it: pages per layer -> the objects' geometry (None: workers seal).
        self.geometry_of: Callable[[int], codec.ObjectGeometry] | None = None
        self.state_geometry: codec.ObjectGeometry | None = None  # a state snapshot's, likewise
        self.in_flight: dict[ObjectKey, int] = {}  # key -> save job reserving its slot
        self.state_groups: set[int] = set()  # recurrent groups: in snapshots, never in KV objects
        self.committed = 0

    # --- planning ------------------------------------------------------------------------------

    def plan(self, st: ReqState, done: int, job_id: int, final: bool = False) -> SaveJob | None:
        """The save job for request ``st`` once ``done`` of its tokens (prompt, then generated)
        have KV.  ``final``: the request ended, so also its last tail (whole blocks past its
        last full chunk)."""
        wanted = self._wanted(st, done, final)
        if not wanted:
            return None
        present = self.io.run(self.store.present([w.key for w in wanted]))
        handles = []
        for w, there in zip(wanted, present):
            if not there and not self._held(st, w):
                self._fail("host", "save:window")  # a sliding layer already let go of its blocks
                st.save_stopped = w.end == 0  # later chunks would be orphans
                break
            if not there and w.key not in self.in_flight:
                handle = self._reserve(w.key, self.object_size(w.pages), w.parent)
                if handle is None:
                    if not self.host.writing_sync(w.key):  # no room: later chunks would be orphans
                        st.save_stopped = True
                        break
                else:
                    groups = [g[w.index * self.pages_per_chunk :][: w.pages] for g in self.kv_groups(st)]
                    handles.append(
                        _Pending(
                            handle,
                            w.key,
                            ChunkCopy(
                                handle.offset,
                                bytes(w.key),
                                groups[0],
                                parent=bytes(st.hashes[w.index - 1]) if w.index else b"",
                                pages=w.pages,
                                generated=w.generated,
                                group_ids=groups if len(groups) > 1 else [],
                            ),
                        )
                    )
            w.done(st)
        return self._job(st, job_id, handles, self.chunk_size)

    def _job(self, st: ReqState, job_id: int, handles: list[_Pending], chunk_tokens: int) -> SaveJob | None:
        """The save job of the slots reserved in ``handles`` (None if there are none)."""
        if not handles:
            return None
        self.jobs[job_id] = handles
        self.in_flight.update(dict.fromkeys((p.key for p in handles), job_id))
        st.had_saves = True
        return SaveJob(job_id, st.view.req_id, [p.chunk for p in handles], chunk_tokens)

    def plan_states(
        self, st: ReqState, entries: list[tuple[int, int, int]], state_groups: list[int], nbytes: int, job_id: int
    ) -> SaveJob | None:
        """Recurrent hybrids: the state snapshots vLLM hands off this step (``entries``:
        (group, block, boundary), its "align" mode's exact blocks).  Each boundary where every
        state group handed a block, inside the prompt where an object of ours ends, is saved as
        one object under ``hits.state_key`` of that object's key.  The worker gathers them
        after this step's forward, before it returns (``WorkerHalf.submit_saves``): the block
        holds that state until vLLM frees it two steps later at the earliest."""
        by_boundary: dict[int, dict[int, int]] = {}
        for group, block, boundary in entries:
            if group in state_groups and block != NULL_BLOCK:
                by_boundary.setdefault(boundary, {})[group] = block
        handles = []
        for t, blocks in sorted(by_boundary.items()):
            base = self.keys.boundary_key(st, t)
            if base is None or len(blocks) != len(state_groups):
                continue
            key = state_key(base)
            if key in self.in_flight or self.io.run(self.store.present([key]))[0]:
                continue
            handle = self._reserve(key, nbytes, base)
            if handle is None:
                continue
            groups = [[blocks[i]] if i in blocks else [] for i in range(max(len(st.groups), max(blocks) + 1))]
            handles.append(
                _Pending(
                    handle,
                    key,
                    ChunkCopy(
                        handle.offset,
                        bytes(key),
                        [],
                        parent=bytes(base.chunk_hash),
                        pages=1,
                        group_ids=groups,
                        state=True,
                    ),
                )
            )
        return self._job(st, job_id, handles, self.block_size)

    def _wanted(self, st: ReqState, done: int, final: bool) -> list[_Wanted]:
        """The objects ``done`` tokens complete: full chunks (prompt or generated), the
        prompt's tail once the prompt is computed, and at the end the request's last tail."""
        if st.save_stopped:
            return []
        c, ppc = self.chunk_size, self.pages_per_chunk
        prompt = len(st.view.prompt)
        self.keys.extend_keys(st, done // c)
        out = [
            _Wanted(i, st.keys[i], st.keys[i - 1] if i else None, ppc, _generated(i * c, (i + 1) * c, prompt))
            for i in range(st.saved_upto, min(done // c, len(st.keys)))
        ]
        if done >= prompt and not st.tail_done:  # the prompt's tail: a repeat of it hits here
            out += self._tail(st, prompt, prompt, prompt_tail=True)
        if final and done > st.final_tail:
            out += [w for w in self._tail(st, done, prompt, prompt_tail=False) if w.key not in {x.key for x in out}]
        return out

    def _tail(self, st: ReqState, end: int, prompt: int, prompt_tail: bool) -> list[_Wanted]:
        """The tail object of the first ``end`` tokens (its whole blocks past the last full chunk)."""
        c, bs = self.chunk_size, self.block_size
        index, pages = end // c, (end % c) // bs
        if pages < 1 or index > len(st.keys):
            return []
        tokens = None if prompt_tail else st.view.all_tokens[:end]
        keys = self.keys.tail_keys(st, index, tokens)
        if len(keys) < pages:
            return []
        start = index * c
        return [
            _Wanted(
                index,
                keys[len(keys) - pages],
                st.keys[index - 1] if index else None,
                pages,
                _generated(start, start + pages * bs, prompt),
                prompt_tail,
                start + pages * bs,
            )
        ]

    def _held(self, st: ReqState, w: _Wanted) -> bool:
        """Whether the engine still holds every block of the object in every KV cache group
        (a sliding-window group frees blocks that left its window, as a decode goes on)."""
        start = w.index * self.pages_per_chunk
        holes = len(st.groups) > 1  # only hybrid models' groups have null blocks
        return all(
            len(g) >= start + w.pages and not (holes and NULL_BLOCK in g[start : start + w.pages])
            for i, g in enumerate(st.groups)
            if i not in self.state_groups
        )

    def kv_groups(self, st: ReqState) -> list[list[int]]:
        """The request's blocks per KV cache group, a recurrent group's left empty: its blocks
        hold states at a few boundaries, not pages (``plan_states``)."""
        if not self.state_groups:
            return st.groups
        return [[] if i in self.state_groups else g for i, g in enumerate(st.groups)]

    def _reserve(self, key: ObjectKey, size: int, parent: ObjectKey | None) -> PutHandle | None:
        try:
            handle = self.host.put_start_sync(key, size, parent)
        except Exception as err:  # noqa: BLE001 - a full or closed pool skips the save
            self._fail("host", f"reserve:{type(err).__name__}")
            return None
        if handle is None and not self.host.writing_sync(key):
            self._fail("host", "save:no_room")  # every byte is pinned, read or not yet written down
        return handle

    # --- outcomes ------------------------------------------------------------------------------

    def report(self, job_id: int, oks: list[bool]) -> None:
        """Every worker's outcome of each object of ``job_id`` (all of them reported)."""
        for pending, ok in zip(self.jobs.pop(job_id, []), oks):
            self.in_flight.pop(pending.key, None)
            if ok and self.geometry_of is not None:
                ok = self._seal(pending)
            self._commit(pending.handle, pending.key, ok)

    def cancel(self, job_id: int) -> int:
        """Give up a job no worker was sent (a reset): its reservations are freed, never
        committed.  Returns how many objects it held."""
        pending = self.jobs.pop(job_id, [])
        for p in pending:
            self.in_flight.pop(p.key, None)
            self.host.put_commit_sync(p.handle, False)
        return len(pending)

    def _seal(self, p: _Pending) -> bool:
        """Seal an object the workers wrote in parts (tensor parallelism): its header and
        the checksum of the whole payload, now that every part has landed."""
        try:
            if p.chunk.state:
                geometry = self.state_geometry
                if geometry is None:
                    raise LookupError("no worker reported its state layout")
            else:
                if self.geometry_of is None:
                    raise LookupError("no worker reported its KV layout")
                geometry = self.geometry_of(p.chunk.pages or self.pages_per_chunk)
        except Exception as err:  # noqa: BLE001 - no layout reported yet, or a bad one: not saved
            self._fail("host", f"seal:{type(err).__name__}")
            return False
        parent = ChunkHash(p.chunk.parent) if p.chunk.parent else ROOT
        codec.encode_into(_buffer(p.handle), p.key, geometry, None, parent, p.chunk.generated)
        return True

    def _commit(self, handle: PutHandle, key: ObjectKey, ok: bool) -> None:
        if ok:
            try:
                # the MAC, before anyone sees it (the worker that wrote it whole sealed it already)
                self.store.seal(key, _buffer(handle)[: handle.size], unless_sealed=True)
            except ObjectFormatError:
                ok = False
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
                for pending in self.jobs[job_id]:
                    if _sealed(pending.handle, pending.key):
                        self.in_flight.pop(pending.key, None)
                        self._commit(pending.handle, pending.key, True)
                        adopted += 1
                    else:
                        left.append(pending)
                if left:
                    self.jobs[job_id] = left
                else:
                    del self.jobs[job_id]
            if not self.jobs or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        if self.jobs:
            log.warning(
                "kvstore: %d saves still unsealed at shutdown are left out", sum(len(h) for h in self.jobs.values())
            )
        return adopted


def _sealed(handle: PutHandle, key: ObjectKey) -> bool:
    try:
        codec.verify(handle.buffer, expected_key=key, length=handle.size)
    except ObjectFormatError:
        return False
    return True


__all__ = ["SavePlanner"]


def _buffer(handle: PutHandle) -> memoryview:
    """A host pool reservation's bytes (the host tier always hands out the slot itself)."""
    if handle.buffer is None:
        raise LookupError(f"the host reservation of {handle.key!r} has no buffer")
    return handle.buffer
