"""The setups ``kvstore bench e2e`` compares, its workload, and one setup's outcome.

Host side, no vLLM import.  Labels name each request's role: ``long-<i>-first`` and
``long-<i>-repeat`` (the same long prompt, sent twice in a row) and ``short-<i>`` (a short
unrelated prompt in between); ``is_kind(label, kind)`` tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness import kit

SHORT_LEN = 64  # under one engine block: never stored, never hit
FIRST, REPEAT, SHORT = "-first", "-repeat", "short-"
# (key, short name for row names, description)
SETUPS = (
    ("none", "none", "no connector (miss and correctness reference)"),
    ("none-pc", "vllm pc", "no connector, vLLM prefix caching on (local hits; hit reference)"),
    ("ours-1", "ours eng1", "our connector, engine 1, empty SSD dir (misses, then host hits)"),
    ("ours-2", "ours eng2", "our connector, engine 2, same SSD dir (SSD hits, then host hits)"),
    ("example", "example", "vLLM ExampleConnector, empty dir (saves, then hits)"),
    ("lmcache", "lmcache", "LMCache 0.5.6 multiprocess server (saves, then hits)"),
)
TITLES = {key: title for key, _, title in SETUPS}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One setup's run in one pass: the engine result, or why there is none."""

    key: str
    result: kit.EngineResult | None = None
    stats: dict | None = None  # our connector's stats_path JSON
    cmp: kit.Comparison | None = None
    cached: frozenset[str] = frozenset()  # labels whose outputs show loaded KV
    error: str | None = None


def build_workload(prompts: int, prompt_len: int, shorts: int, vocab: int) -> kit.Workload:
    """Each long prompt sent twice in a row; a short unrelated one after each of the first
    `shorts` pairs."""
    g, reqs = kit.TokenSource(0, vocab), []
    for i in range(prompts):
        tokens = g.take(prompt_len)
        reqs += [kit.Request(f"long-{i}{FIRST}", tokens), kit.Request(f"long-{i}{REPEAT}", tokens)]
        if i < shorts:
            reqs.append(kit.Request(f"{SHORT}{i}", g.take(SHORT_LEN)))
    return kit.Workload(tuple(reqs))


def is_kind(label: str, kind: str) -> bool:
    """Whether ``label`` is a request of ``kind`` (``FIRST``, ``REPEAT`` or ``SHORT``)."""
    return label.startswith(kind) if kind == SHORT else label.endswith(kind)
