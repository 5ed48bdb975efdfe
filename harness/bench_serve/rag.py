"""The ``rag`` workload of ``kvstore bench serve``: a set of documents shared by many
questions, in varied order.

Host side, no vLLM import.  A short system prompt, then ``per_prompt`` documents drawn from a
set of ``documents`` (seeded, without repeats in one prompt, more popular ones more often:
document r is drawn with weight 1/(r+1)), each in the order drawn, then a question of its
own.  ``sessions`` users each ask one question per round, for ``turns`` rounds; every user's
round t before any round t+1, ``concurrency`` requests in flight.  The same documents come
back in other orders and combinations, so only the prefix up to the first document that
differs is a prefix hit; later turns are the rounds >= 2.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from harness.bench_serve.workload import Between, Tokens, WorkloadRun, blocks, run_rounds
from harness.kit import TokenSource
from harness.openai_server import OpenAIServer


@dataclass(frozen=True, slots=True)
class RagSpec:
    sessions: int = 16  # users, one question each per round
    turns: int = 3  # rounds
    system: int = 128  # tokens of the system prompt every question shares
    documents: int = 12  # documents in the shared set
    document: int = 256  # tokens per document
    per_prompt: int = 3  # documents per question
    message: int = 32  # tokens of a question
    answer: int = 16  # generated tokens per question
    concurrency: int = 4  # streamed requests in flight
    seed: int = 0


def draw(rng: random.Random, documents: int, k: int) -> tuple[int, ...]:
    """``k`` distinct documents, document r with weight 1/(r+1), in the order drawn."""
    left, chosen = list(range(documents)), []
    for _ in range(k):
        r = rng.choices(left, weights=[1 / (d + 1) for d in left])[0]
        left.remove(r)
        chosen.append(r)
    return tuple(chosen)


class Rag:
    """Rounds of questions over a shared document set; see the module docstring."""

    name = "rag"
    restart_after = None

    def __init__(self, spec: RagSpec, vocab: int) -> None:
        from kvstore.errors import ConfigError

        if spec.per_prompt > spec.documents:
            raise ConfigError(f"rag: --per-prompt {spec.per_prompt} exceeds --documents {spec.documents}")
        self.spec = spec
        g, rng = TokenSource(spec.seed, vocab), random.Random(spec.seed + 1)
        self.system = g.take(spec.system)
        self.docs = [g.take(spec.document) for _ in range(spec.documents)]
        # choice[t][i]: user i's documents in round t+1, and its question
        self.choice = [
            [(draw(rng, spec.documents, spec.per_prompt), g.take(spec.message)) for _ in range(spec.sessions)]
            for _ in range(spec.turns)
        ]

    def prompt(self, t: int, i: int) -> Tokens:
        docs, question = self.choice[t - 1][i]
        return self.system + sum((self.docs[d] for d in docs), ()) + question

    def describe(self) -> str:
        s = self.spec
        lead = [c[0][0] for round_ in self.choice for c in round_]
        return (
            f"{s.sessions} users x {s.turns} rounds, {s.per_prompt} of {s.documents} documents of "
            f"{s.document} tokens per question (system {s.system}, question {s.message}, answer {s.answer}), "
            f"{s.concurrency} in flight; {len(set(lead))} distinct leading documents over {len(lead)} questions"
        )

    def longest(self) -> int:
        s = self.spec
        return s.system + s.per_prompt * s.document + s.message + s.answer

    def limit_blocks(self, block_size: int) -> int:
        return self.spec.sessions * self.spec.turns * blocks(self.longest(), block_size)

    def settings(self) -> dict:
        return {k: getattr(self.spec, k) for k in self.spec.__slots__} | {
            "documents_per_question": [[list(c[0]) for c in round_] for round_ in self.choice]
        }

    def run(self, server: OpenAIServer, between: Between | None = None, hints: bool = False) -> WorkloadRun:
        """``hints`` are not sent: a user's questions share documents, not a session."""
        s = self.spec

        def prompts(t: int) -> list[tuple[int, Tokens]]:
            return [(i, self.prompt(t, i)) for i in range(s.sessions)]

        return run_rounds(server, s.turns, prompts, s.answer, s.concurrency, between)
