"""Saves (planned by ``connector.saves``).  When a step completes a full prompt chunk (or the whole
prompt: its tail) that no tier holds, a host slot is reserved (incomplete, invisible) and
the worker gathers the pages into it after the forward; the worker's report commits it
(visible), then the core's write-down copies it to the lower tiers.  A finished request
whose saves were planned keeps its blocks (``delay_free``) until the worker says the
gathers are done.  When the process exits, or the engine shuts down, saves already sealed
in their slots are committed and everything committed is written down before the tiers
close (``flush_at_exit``).

Which save jobs the workers still owe a report, per request: a finished request whose saves
were planned keeps its blocks (``delay_free``) until every gather reported.  Final saves
(planned at ``request_finished``) wait here for the next step plan; a reset cancels them and
the workers are told the blocks may go (``released``), as they are for a finished request
whose gathers all reported (``undelayed``).  Scheduler side; no I/O."""

from __future__ import annotations

from connector.plan import SaveJob
from connector.saves import SavePlanner


class SaveJobs:
    def __init__(self) -> None:
        self.final: list[SaveJob] = []  # planned at request_finished, sent with the next step
        self.released: list[str] = []  # requests whose final saves a reset cancelled (next plan)
        self.undelayed: list[str] = []  # finished requests whose gathers all reported (next plan)
        self._unreported: dict[str, set[int]] = {}  # req id -> its save jobs the workers have not reported
        self._owner: dict[int, str] = {}  # save job -> req id, while unreported

    def sent(self, job: SaveJob) -> SaveJob:
        """A save job sent to the workers: its request's blocks are needed until they report it."""
        self._unreported.setdefault(job.req_id, set()).add(job.job_id)
        self._owner[job.job_id] = job.req_id
        return job

    def reported(self, job_id: int) -> None:
        req_id = self._owner.pop(job_id, None)
        if req_id is None:
            return
        jobs = self._unreported.get(req_id)
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._unreported[req_id]

    def unreported(self, req_id: str) -> bool:
        """Whether the workers still owe a report of one of ``req_id``'s save jobs."""
        return bool(self._unreported.get(req_id))

    def take_final(self) -> list[SaveJob]:
        jobs, self.final = self.final, []
        return jobs

    def take_told(self) -> tuple[list[str], list[str]]:
        """(released, undelayed) since the last step plan."""
        told, self.released, self.undelayed = (self.released, self.undelayed), [], []
        return told

    def cancel_final(self, saves: SavePlanner) -> int:
        """A reset: the final saves not yet sent are cancelled (their slots given back) and
        their blocks released; returns the slots cancelled."""
        cancelled = 0
        for job in self.take_final():
            cancelled += saves.cancel(job.job_id)
            self.reported(job.job_id)
            self.released.append(job.req_id)
        return cancelled


__all__ = ["SaveJobs"]
