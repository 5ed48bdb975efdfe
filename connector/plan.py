"""What the scheduler half tells the worker half each step, and what the worker reports back.

Both are plain picklable dataclasses: in vLLM's multi-process mode they cross a process
boundary (scheduler → worker inside the step's connector metadata; worker → scheduler
inside ``kv_connector_worker_meta``).  The scheduler owns every decision (which slot, which
key, which blocks); the worker only moves bytes between the shared host pool and the
engine's blocks, by job id, and reports the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NULL_BLOCK = 0  # vLLM's null block: in hybrid models, a sliding-window group's blocks outside its window


def as_groups(blocks) -> list[list[int]]:
    """Block ids per KV cache group, from vLLM's tuple of lists (hybrid models) or from one
    flat list of ids (one group)."""
    blocks = list(blocks)
    if blocks and not isinstance(blocks[0], int):
        return [list(g) for g in blocks]
    return [blocks]


@dataclass(slots=True)
class ChunkCopy:
    """One object of ``pages`` pages per layer at byte offset ``slot`` of the pool, and the
    engine blocks of its pages ``page_offset .. page_offset + len(block_ids)``.  A full chunk
    has the plan's ``pages_per_chunk`` pages; a tail object (the whole blocks of a prompt's
    last, partial chunk) has fewer.  ``key`` is the ObjectKey's bytes: the worker checks the
    object's header names it before a load, and writes it into the header on a save."""

    slot: int
    key: bytes
    block_ids: list[int]
    page_offset: int = 0  # loads: the first page of the object that block_ids[0] receives
    parent: bytes = b""  # saves: the parent chunk hash written into the header
    pages: int = 0  # pages per layer of the object; 0: the plan's pages_per_chunk
    generated: int = 0  # saves: how many of its tokens the engine generated (into the header)
    group_ids: list[list[int]] = field(default_factory=list)  # hybrid models: the blocks per KV
    # cache group (block_ids is group 0's)
    state: bool = False  # a recurrent-state snapshot: one page per state layer, from the block
    # ``group_ids[g][0]`` of each state group g (empty for the others), or
    # into every block listed there (the boundary's, then the step's running one)
    boundary: int = 0  # state loads: the token the snapshot stands at

    def groups(self) -> list[list[int]]:
        """The block ids of each KV cache group (one group: ``block_ids``).  ``NULL_BLOCK``
        marks a block the engine does not hold (a sliding-window layer outside its window)."""
        return self.group_ids or [self.block_ids]


@dataclass(slots=True)
class LoadJob:
    job_id: int
    req_id: str
    chunks: list[ChunkCopy]

    @property
    def block_ids(self) -> list[int]:
        return [
            b
            for c in self.chunks
            if not c.state
            for g in c.groups()
            for b in g
            if not (c.group_ids and b == NULL_BLOCK)
        ]


@dataclass(slots=True)
class SaveJob:
    job_id: int
    req_id: str
    chunks: list[ChunkCopy]
    chunk_tokens: int = 0


@dataclass(slots=True)
class StepPlan:
    pool_path: str
    pool_size: int
    pages_per_chunk: int
    chunk_tokens: int
    page_bytes: int  # the scheduler's view of one page; the worker checks it matches its own
    state_page_bytes: int = 0  # recurrent hybrids: one state layer's page (the worker checks it too)
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # requests whose final saves a reset cancelled
    undelayed: list[str] = field(default_factory=list)  # finished, every gather reported: blocks freed

    @property
    def has_sync_loads(self) -> bool:
        return bool(self.loads)


@dataclass(slots=True)
class WorkerReport:
    """Outcomes since the last report.  ``loads``: job id → ok.  ``saves``: job id → ok per
    chunk.  With several workers (TP) a job is ok only if it is ok on every worker: the
    ``*_reports`` counts say how many workers a merged outcome stands for, because workers
    finish a job's copies at their own pace and may report it in different steps."""

    loads: dict[int, bool] = field(default_factory=dict)
    saves: dict[int, list[bool]] = field(default_factory=dict)
    load_reports: dict[int, int] = field(default_factory=dict)  # job -> workers that reported it
    save_reports: dict[int, int] = field(default_factory=dict)  # job -> workers that reported it
    layout: tuple[str, str] | None = None  # (dtype, layout id) of the canonical page
    state_layout: str | None = None  # layout id of the canonical state page (recurrent hybrids)
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    bytes_saved: int = 0
    save_seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    damaged: list[bytes] = field(default_factory=list)  # keys whose slot failed verification
    stages: list[tuple[str, float]] = field(default_factory=list)  # (lifecycle state, seconds)
    # Timestamps (time.monotonic) for the stats log and the trace (connector.observe):
    timings: dict[int, list[list[tuple[str, float]]]] = field(default_factory=dict)  # load job -> each
    #                                                  ticket's (state, t) history
    save_times: dict[int, tuple[float, list[float]]] = field(default_factory=dict)  # save job -> (issued,
    #                                                  each chunk's snapshot done)
    copies: list[tuple[str, float, float]] = field(default_factory=list)  # copy jobs run: (what, t0, t1)

    def merge(self, other: WorkerReport) -> WorkerReport:
        for job, ok in other.loads.items():
            self.loads[job] = self.loads.get(job, True) and ok
        for job, oks in other.saves.items():
            mine = self.saves.get(job)
            self.saves[job] = oks if mine is None else [a and b for a, b in zip(mine, oks)]
        for counts, theirs in ((self.load_reports, other.load_reports), (self.save_reports, other.save_reports)):
            for job, n in theirs.items():
                counts[job] = counts.get(job, 0) + n
        self.layout = self.layout or other.layout
        self.state_layout = self.state_layout or other.state_layout
        self.bytes_loaded += other.bytes_loaded
        self.load_seconds = max(self.load_seconds, other.load_seconds)
        self.bytes_saved += other.bytes_saved
        self.save_seconds = max(self.save_seconds, other.save_seconds)
        for reason, n in other.failures.items():
            self.failures[reason] = self.failures.get(reason, 0) + n
        self.damaged += [k for k in other.damaged if k not in self.damaged]
        self.stages += other.stages
        self.timings.update(other.timings)  # one rank's timestamps stand for the job
        self.save_times.update(other.save_times)
        self.copies += other.copies
        return self

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.failures or self.damaged or self.copies)


class ReportCollector:
    """Scheduler side: a job's outcome once every worker reported it.  With TP (and PP) each
    of ``workers`` workers reports every job, at its own pace, possibly in different steps:
    a part not yet landed is not a whole."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._partial: dict[tuple[str, int], tuple[int, Any]] = {}  # (kind, job) -> (reports, outcome)

    def collect(self, kind: str, job_id: int, n: int, outcome: Any, combine: Callable[[Any, Any], Any]) -> Any:
        """``n`` more workers reported ``outcome`` for job ``(kind, job_id)``: the outcome
        combined over all workers once every one did, None before that."""
        key = (kind, job_id)
        count, acc = self._partial.pop(key, (0, None))
        count, acc = count + n, outcome if acc is None else combine(acc, outcome)
        if count < self.workers:
            self._partial[key] = (count, acc)
            return None
        return acc
