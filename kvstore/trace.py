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

Overhead is bounded: recording an event appends a small tuple under a lock (about a
microsecond); a writer thread of the tracer's own encodes and writes them ``FLUSH_EVERY`` at
a time, ``WRITE_SLICE`` events between yielding the GIL, and the rest at ``flush``/``close``,
so no caller waits for JSON or the disk (and a flush holds the GIL for well under a
millisecond at a time).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

FLUSH_EVERY = 8192  # events buffered before the writer thread takes them
WRITE_SLICE = 64  # events the writer encodes between giving the GIL away


class Tracer:
    """One trace file (see the module docstring).  Thread-safe."""

    def __init__(self, path: str | os.PathLike, process: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._file.write("[\n")
        self._t0 = time.monotonic()
        self._pid = os.getpid()
        # _lock guards _buf, _tracks and _closed; the writer thread alone touches _file.
        self._lock = threading.Lock()
        self._buf: list[tuple] = []
        self._tracks: dict[str, int] = {}
        self._closed = False
        self._full: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_forever, name="kvstore-trace", daemon=True)
        self._writer.start()
        self._add(("M", 0, "process_name", {"name": process}))

    def track(self, name: str, order: int | None = None) -> int:
        """The id of track ``name`` (made, named and ordered on first use)."""
        tid = self._tracks.get(name)
        if tid is not None:
            return tid
        with self._lock:
            tid = self._tracks.get(name)
            if tid is not None:
                return tid
            tid = self._tracks[name] = len(self._tracks) + 1
        self._add(("M", tid, "thread_name", {"name": name}))
        self._add(("M", tid, "thread_sort_index", {"sort_index": tid if order is None else order}))
        return tid

    def span(
        self, tid: int, name: str, start: float, end: float, args: dict | None = None, cat: str = "kvstore"
    ) -> None:
        """A span of track ``tid`` from ``start`` to ``end`` (``time.monotonic()`` seconds)."""
        self._add(("X", tid, name, args, cat, start, end))

    def instant(self, tid: int, name: str, at: float, args: dict | None = None, cat: str = "kvstore") -> None:
        self._add(("i", tid, name, args, cat, at))

    def _add(self, event: tuple) -> None:
        """The hot path: a tuple appended; a full buffer goes to the writer thread."""
        with self._lock:
            if self._closed:
                return
            self._buf.append(event)
            if len(self._buf) < FLUSH_EVERY:
                return
            full, self._buf = self._buf, []
        self._full.put(full)

    def flush(self) -> None:
        """Hand what is buffered to the writer and wait until it is in the file."""
        done = threading.Event()
        with self._lock:
            full, self._buf = self._buf, []
        self._full.put(full)
        self._full.put([("sync", done)])
        done.wait(10)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            full, self._buf = self._buf, []
        self._full.put(full)
        self._full.put(None)
        self._writer.join(10)

    # --- the writer thread ----------------------------------------------------------------

    def _write_forever(self) -> None:
        while (batch := self._full.get()) is not None:
            if batch and batch[0][0] == "sync":
                batch[0][1].set()
                continue
            for i in range(0, len(batch), WRITE_SLICE):
                self._file.write(
                    "".join(
                        json.dumps(self._event(e), separators=(",", ":"), default=str) + ",\n"
                        for e in batch[i : i + WRITE_SLICE]
                    )
                )
                time.sleep(0)  # let the engine's threads have the GIL: they never wait for this one long
            self._file.flush()
        self._file.write("{}]\n")
        self._file.close()

    def _event(self, e: tuple) -> dict:
        kind, tid, name = e[0], e[1], e[2]
        if kind == "M":
            return {"ph": "M", "name": name, "pid": self._pid, "tid": tid, "args": e[3]}
        out = {"ph": kind, "name": name, "cat": e[4], "pid": self._pid, "tid": tid, "ts": self._us(e[5])}
        if kind == "X":
            out["dur"] = max(0.0, round((e[6] - e[5]) * 1e6, 1))
        else:
            out["s"] = "t"
        if e[3]:
            out["args"] = e[3]
        return out

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)


class Lanes:
    """Spans of one kind that may overlap (concurrent calls), each put on the first of the
    tracks ``<name> #1``, ``#2``... where it overlaps nothing: spans are added when they
    end, so a lane is free when its last span ended before this one started."""

    def __init__(self, tracer: Tracer, name: str, order: int | None = None) -> None:
        self.tracer, self.name, self.order = tracer, name, order
        self._lock = threading.Lock()  # guards _ends
        self._ends: list[float] = []  # per lane: when its last span ended

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
