"""What the scheduler half shows of each request: how long each stage of its load took (in
its stats entry, and as p50/p99 per stage in the stats file) and, with ``trace_path``, a
stage trace in Chrome's trace-event JSON (``kvstore.trace``) that Perfetto opens.
Scheduler side; every hook runs on the scheduler's thread.

A load's stages (docs/architecture.md#completion-moments), each the time spent *in* that state until the next one:

* ``looked_up``: from the request's first lookup until the decision (a prefetch from a
  lower tier into host memory is inside it);
* ``readable``: the slot pinned (promised to the engine) until the bytes are verified in it
  (waiting for the engine's next step is inside it);
* ``in_buffer``: verified, until the last layer's copy into the engine's blocks completed;
* ``on_device``: until the compute stream may read them (``consumable``);
* ``consumable``: until the pins are released.

The first two moments are the scheduler's, the others the worker's (its tickets'
timestamps, ``WorkerReport.timings``); all are ``time.monotonic()``, one clock per host.

Tracks of the trace:

* ``req <id>``: the request (first lookup → finished), the prefetch, the decision (an
  instant naming the outcome, with the cost model's inputs: loaded or recomputed, and why),
  and the load (decision → last chunk released);
* ``req <id> chunk <i>``: one load ticket: a span per stage, nested in the chunk's span;
* ``req <id> saves``: each save job (planned → committed), its ``gather_issued`` (the copy
  out of the engine's blocks) and ``snapshot_done`` (sealed, waiting for the commit)
  stages, and an instant when each object reached a lower tier (``persisted``);
* ``copy stream rank <r>``: every copy job the worker ran, in order (the load's verify
  and per-layer scatters, the saves' gathers).
"""

from __future__ import annotations

import time
from pathlib import Path

from connector.plan import StepPlan, WorkerReport
from connector.requests import ReqState
from kvstore.keys import ObjectKey
from kvstore.metrics import HitStats
from kvstore.trace import Tracer
from tiers.base import Removal

STAGES = ("looked_up", "readable", "in_buffer", "on_device", "consumable")
PERF_TO_MONO = time.monotonic() - time.perf_counter()  # ReqState keeps perf_counter times


class RequestObserver:
    """Stage timings of each request's load, into its stats entry and the trace."""

    def __init__(self, stats: HitStats, stats_lock, trace_path: Path | None = None, host: str = "host") -> None:
        self.stats, self._stats_lock, self.host = stats, stats_lock, host
        self.tracer = Tracer(trace_path, "kvstore connector (scheduler)") if trace_path else None
        self._found: dict[str, float] = {}  # req -> its first lookup
        self._decided: dict[str, tuple[float, dict]] = {}  # req -> (decision time, stats entry)
        self._loads: dict[int, str] = {}  # load job -> req
        self._saves: dict[int, tuple[str, float, list[bytes]]] = {}  # save job -> (req, planned, keys)
        self._saving: dict[bytes, str] = {}  # key being written down -> req
        self._ended: set[str] = set()  # finished requests whose load's report is still to come

    # --- hooks of connector.scheduler ---------------------------------------------------

    def found(self, st: ReqState) -> None:
        self._found.setdefault(st.view.req_id, time.monotonic())

    def decided(self, st: ReqState, entry: dict) -> None:
        req, now = st.view.req_id, time.monotonic()
        self._decided[req] = (now, entry)
        if self.tracer is None:
            return
        tid = self._track(req)
        tier, _, started = st.prefetch_plan
        if started:
            self.tracer.span(tid, f"prefetch from {tier}", started + PERF_TO_MONO, now)
        outcome = (st.decision or {}).get("outcome", "miss")
        self.tracer.instant(tid, f"decision: {outcome}", now, st.decision)

    def planned(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for job in plan.loads:
            self._loads[job.job_id] = job.req_id
        for save in plan.saves:
            self._saves[save.job_id] = (save.req_id, now, [c.key for c in save.chunks])

    def reported(self, report: WorkerReport) -> None:
        now = time.monotonic()
        for job, histories in report.timings.items():
            req = self._loads.pop(job, None)
            if req is not None and histories:
                self._load_done(req, job, histories)
            if req in self._ended and req not in self._loads.values():
                self._forget(req)
        for job, (issued, done) in report.save_times.items():
            planned = self._saves.pop(job, None)
            if planned is not None:
                self._save_done(job, *planned, issued, done, now)
        if self.tracer is not None:
            for what, t0, t1 in report.copies:
                rank, _, copy = what.partition(": ")
                self.tracer.span(self.tracer.track(f"copy stream {rank}", order=0), copy, t0, t1)

    def finished(self, req: str) -> None:
        found = self._found.get(req)
        if req in self._loads.values():
            self._ended.add(req)  # its load's report is still to come (a one-token request)
        else:
            self._forget(req)
        if self.tracer is not None and found is not None:
            self.tracer.span(self._track(req), "request", found, time.monotonic(), {"req_id": req})

    def _forget(self, req: str) -> None:
        self._found.pop(req, None)
        self._decided.pop(req, None)
        self._ended.discard(req)

    # --- residency (the write-down reaching a lower tier) -------------------------------

    def stored(self, tier: str, key: ObjectKey) -> None:
        req = self._saving.get(bytes(key))
        if req is not None and self.tracer is not None and tier != self.host:
            self.tracer.instant(self._track(req, "saves"), f"persisted {tier}", time.monotonic())

    def removed(self, tier: str, key: ObjectKey, reason: Removal) -> None:
        return

    # --- stages -------------------------------------------------------------------------

    def _load_done(self, req: str, job: int, histories: list[list[tuple[str, float]]]) -> None:
        """Each ticket's stages; the request's (when every chunk reached each state) go into
        its stats entry and the per-stage samples."""
        found = self._found.get(req)
        decided, entry = self._decided.get(req, (None, None))
        times = [self._moments(h, found, decided) for h in histories]
        per_stage = _request_stages(times)
        if entry is not None:
            with self._stats_lock:
                self.stats.amend(entry, stages={k: round(v, 6) for k, v in per_stage.items()})
                for stage, seconds in per_stage.items():
                    self.stats.observe_stage(stage, seconds)
        if self.tracer is None:
            return
        chunks = entry.get("chunks", []) if entry is not None else []
        ends = [t[-1][1] for t in times]
        if decided is not None:
            self.tracer.span(self._track(req), f"load job {job}", decided, max(ends), {"chunks": len(times)})
        for i, moments in enumerate(times):
            tid = self._track(req, f"chunk {i}")
            where = chunks[i]["tier"] if i < len(chunks) else "?"
            args = chunks[i] if i < len(chunks) else None
            self.tracer.span(tid, f"chunk {i} from {where}", moments[0][1], moments[-1][1], args)
            for (state, t0), (_, t1) in zip(moments, moments[1:]):
                self.tracer.span(tid, state.lower(), t0, t1)

    @staticmethod
    def _moments(
        history: list[tuple[str, float]], found: float | None, decided: float | None
    ) -> list[tuple[str, float]]:
        """The worker's ticket history with the scheduler's own first two moments: when the
        object was looked up, and when its slot was pinned (the worker's ticket is created
        READABLE: the pin was taken before the plan)."""
        moments = list(history)
        if (
            found is not None
            and decided is not None
            and len(moments) >= 2
            and moments[0][0] == "LOOKED_UP"
            and moments[1][0] == "READABLE"
        ):
            moments[0] = ("LOOKED_UP", min(found, decided))
            moments[1] = ("READABLE", min(decided, moments[1][1]))
        return moments

    def _save_done(
        self, job: int, req: str, planned: float, keys: list[bytes], issued: float, done: list[float], committed: float
    ) -> None:
        snapshot = max(done) if done else issued
        self.stats.observe_stage("gather_issued", max(0.0, snapshot - issued))
        for key in keys:
            self._saving[key] = req
            if len(self._saving) > 4096:
                self._saving.pop(next(iter(self._saving)))
        if self.tracer is None:
            return
        tid = self._track(req, "saves")
        self.tracer.span(tid, f"save job {job}", planned, committed, {"objects": len(keys)})
        self.tracer.span(tid, "planned", planned, issued)
        self.tracer.span(tid, "gather_issued", issued, snapshot)
        self.tracer.span(tid, "snapshot_done", snapshot, committed)

    def _track(self, req: str, sub: str = "") -> int:
        if self.tracer is None:  # every caller checks first: a track without a trace is a bug
            raise LookupError("RequestObserver: no trace is being written")
        return self.tracer.track(f"req {req}" + (f" {sub}" if sub else ""))

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()


def _request_stages(times: list[list[tuple[str, float]]]) -> dict[str, float]:
    """Seconds in each stage for the whole load: from the moment the last chunk reached a
    state to the moment the last one reached the next (a failed load stops where it
    failed)."""
    reached: dict[str, float] = {}
    for moments in times:
        for state, t in moments:
            reached[state] = max(reached.get(state, t), t)
    order = [s.upper() for s in STAGES] + ["RELEASED"]
    out = {}
    for a, b in zip(order, order[1:]):
        if a in reached and b in reached:
            out[a.lower()] = max(0.0, reached[b] - reached[a])
    return out


__all__ = ["RequestObserver", "STAGES"]
