"""Checks of a Chrome trace-event file (``kvstore.trace``), shared by the fast story and the
engine test: the file parses, every span lies inside its parent or after it on its track,
and each load ticket's stages come in lifecycle order, back to back."""

from __future__ import annotations

from collections import defaultdict

LOAD_STAGES = ["looked_up", "readable", "in_buffer", "on_device", "consumable"]
EPS_US = 1.0  # ts and dur are rounded to 0.1 µs each


def spans_by_track(events: list[dict]) -> dict[tuple[int, int], list[dict]]:
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and {"name", "pid", "tid", "ts"} <= set(e), e
            tracks[(e["pid"], e["tid"])].append(e)
    for spans in tracks.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    return tracks


def check_nesting(events: list[dict]) -> None:
    """On every track, a span starts after the previous one ended or lies inside it."""
    for track, spans in spans_by_track(events).items():
        stack: list[dict] = []
        for e in spans:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - EPS_US:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + EPS_US, (
                    f"track {track}: {e['name']} overlaps {top['name']} without nesting"
                )
            stack.append(e)


def track_names(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def ticket_stages(events: list[dict]) -> list[tuple[str, list[str]]]:
    """(chunk span name, its stage spans in time order) of every load ticket track; asserts
    that each track's stages lie inside its chunk span, back to back."""
    names, out = track_names(events), []
    for track, spans in spans_by_track(events).items():
        if " chunk " not in names.get(track, ""):
            continue
        roots = [s for s in spans if s["name"].startswith("chunk ")]
        for root in roots:
            end = root["ts"] + root["dur"]
            stages = [s for s in spans if s is not root and root["ts"] - EPS_US <= s["ts"] <= end + EPS_US]
            for a, b in zip(stages, stages[1:]):
                assert abs(a["ts"] + a["dur"] - b["ts"]) <= EPS_US, (a, b)
            out.append((root["name"], [s["name"] for s in stages]))
    return out
