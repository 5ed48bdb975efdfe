"""Stage traces in Chrome's trace-event JSON (``trace_path``): Perfetto (ui.perfetto.dev) and
chrome://tracing open the file as it is.  Used by the connector's scheduler half and by the
store process; each writes its own file.

The file is the *JSON array format*: ``[`` then one event per line, each followed by a
comma, and ``{}]`` at ``close``.  The format lets the closing bracket be missing, so a file
cut short by a crash still opens.  Events:

* ``X`` (complete) spans: ``ts``/``dur`` in microseconds, on one track (``tid``) of the
  process (``pid``).  Spans of a track nest (a child lies inside its parent) and never
  overlap otherwise: callers put concurrent things on different tracks.
* ``i`` instants (a decision, a tier written), ``M`` metadata naming the process and each
  track (``thread_name``) and ordering the tracks (``thread_sort_index``).

Times are ``time.monotonic()`` seconds (the lifecycle tickets' clock; one clock for every
process of a host), written relative to the tracer's start.

Overhead is bounded: an event is a small tuple appended under a lock; they are encoded and
written ``FLUSH_EVERY`` at a time, by whichever thread adds the one that fills the buffer,
and at ``close``.  Each event costs a few microseconds in all.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

FLUSH_EVERY = 2048


class Tracer:
    """One trace file (see the module docstring).  Thread-safe."""

    def __init__(self, path: str | os.PathLike, process: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._file.write("[\n")
        self._t0 = time.monotonic()
        self._pid = os.getpid()
        # _lock guards _buf, _tracks, _file and _closed.
        self._lock = threading.Lock()
        self._buf: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._closed = False
        self._add({"ph": "M", "name": "process_name", "pid": self._pid, "tid": 0, "args": {"name": process}})

    def track(self, name: str, order: int | None = None) -> int:
        """The id of track ``name`` (made, named and ordered on first use)."""
        with self._lock:
            tid = self._tracks.get(name)
            if tid is not None:
                return tid
            tid = self._tracks[name] = len(self._tracks) + 1
        self._add({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": name}})
        self._add({"ph": "M", "name": "thread_sort_index", "pid": self._pid, "tid": tid,
                   "args": {"sort_index": tid if order is None else order}})
        return tid

    def span(self, tid: int, name: str, start: float, end: float, args: dict | None = None,
             cat: str = "kvstore") -> None:
        """A span of track ``tid`` from ``start`` to ``end`` (``time.monotonic()`` seconds)."""
        event = {"ph": "X", "name": name, "cat": cat, "pid": self._pid, "tid": tid,
                 "ts": self._us(start), "dur": max(0.0, round((end - start) * 1e6, 1))}
        if args:
            event["args"] = args
        self._add(event)

    def instant(self, tid: int, name: str, at: float, args: dict | None = None, cat: str = "kvstore") -> None:
        event = {"ph": "i", "s": "t", "name": name, "cat": cat, "pid": self._pid, "tid": tid, "ts": self._us(at)}
        if args:
            event["args"] = args
        self._add(event)

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)

    def _add(self, event: dict) -> None:
        with self._lock:
            if self._closed:
                return
            self._buf.append(event)
            if len(self._buf) >= FLUSH_EVERY:
                self._write()

    def flush(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        """Caller holds ``_lock``."""
        if self._buf and not self._closed:
            self._file.write("".join(json.dumps(e, separators=(",", ":"), default=str) + ",\n" for e in self._buf))
            self._file.flush()
        self._buf.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._write()
            self._file.write("{}]\n")
            self._file.close()
            self._closed = True


class Lanes:
    """Spans of one kind that may overlap (concurrent calls), each put on the first of the
    tracks ``<name> #1``, ``#2``... where it overlaps nothing: spans are added when they
    end, so a lane is free when its last span ended before this one started."""

    def __init__(self, tracer: Tracer, name: str, order: int | None = None) -> None:
        self.tracer, self.name, self.order = tracer, name, order
        self._lock = threading.Lock()  # guards _ends
        self._ends: list[float] = []   # per lane: when its last span ended

    def span(self, name: str, start: float, end: float, args: dict | None = None) -> None:
        with self._lock:
            lane = next((i for i, t in enumerate(self._ends) if t <= start), len(self._ends))
            if lane == len(self._ends):
                self._ends.append(end)
            else:
                self._ends[lane] = end
        tid = self.tracer.track(f"{self.name} #{lane + 1}", None if self.order is None else self.order + lane)
        self.tracer.span(tid, name, start, end, args)


def load(path: str | os.PathLike) -> list[dict]:
    """The events of a trace file (its closing bracket may be missing), empty ``{}`` dropped."""
    text = Path(path).read_text().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return [e for e in json.loads(text) if e]


__all__ = ["FLUSH_EVERY", "Lanes", "Tracer", "load"]
