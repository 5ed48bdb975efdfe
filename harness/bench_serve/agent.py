"""The ``agent`` workload of ``kvstore bench serve``: long contexts grown by tool outputs,
many turns, seeded pauses of varied length between turns, and forks.

Host side, no vLLM import.  Every session opens with a system prompt all share and a task of
its own; turn 1's prompt is that opening, turn t+1's is turn t's prompt, its answer and a tool
output of a seeded length (``tool`` on average, from half to one and a half times it).  A
fork is a sub-session: it takes its parent's whole history after a seeded turn ``at`` as its
own prefix and goes on with tool outputs of its own for turns at+1.. (numbered as its
parent's, so a fork's first turn is a later turn: a cache can serve it).

Sessions run at their own pace, not in lock step: each is a thread that pauses (seeded,
exponential around ``pause`` seconds, at most four times it; the first pause staggers the
starts), then sends its next turn when one of ``concurrency`` request slots is free.  The
pauses are the workload's, not serving time (``harness.bench_serve.workload.busy_s``).
Prompts depend only on the session's own answers, which are greedy, so every setup is sent
the same prompts whatever the threads' interleaving.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from harness.bench_serve.workload import Between, Tokens, Turn, WorkloadRun, blocks, finished, session_params
from harness.kit import TokenSource
from harness.openai_server import OpenAIServer


@dataclass(frozen=True, slots=True)
class AgentSpec:
    sessions: int = 8
    turns: int = 8
    system: int = 512  # tokens of the system prompt every session shares
    context: int = 256  # tokens of each session's task
    tool: int = 128  # mean tokens of a tool output (one per turn after the first)
    answer: int = 16  # generated tokens per turn
    forks: int = 4  # sub-sessions, each from a parent's history after a seeded turn
    pause: float = 0.5  # mean seconds between a session's turns
    concurrency: int = 4  # streamed requests in flight
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Branch:
    """A session (``parent`` None) or a fork of one, from turn ``first``."""

    id: int
    first: int  # the number of its first turn
    messages: tuple[Tokens, ...]  # what each of its turns adds before the answer
    pauses: tuple[float, ...]  # seconds before each of its turns
    parent: int | None = None


class Agent:
    """Sessions and forks, each at its own pace; see the module docstring."""

    name = "agent"
    restart_after = None

    def __init__(self, spec: AgentSpec, vocab: int) -> None:
        from kvstore.errors import ConfigError

        if spec.forks < 0 or spec.pause < 0:
            raise ConfigError(f"agent: --forks {spec.forks} and --pause {spec.pause:g} must not be negative")
        if spec.forks and spec.turns < 2:
            raise ConfigError(f"agent: --forks {spec.forks} needs --turns >= 2 (a fork starts after a turn)")
        self.spec = spec
        g, rng = TokenSource(spec.seed, vocab), random.Random(spec.seed + 1)
        system = g.take(spec.system)
        self.openings = [system + g.take(spec.context) for _ in range(spec.sessions)]
        self.seqs = [self._sequence(i, 1, g, rng) for i in range(spec.sessions)]
        self.fork_at: dict[int, int] = {}  # fork id -> the parent's turn it starts after
        for j in range(spec.forks):
            at = rng.randint(1, spec.turns - 1)
            fork = self._sequence(spec.sessions + j, at + 1, g, rng, parent=j % spec.sessions)
            self.fork_at[fork.id] = at
            self.seqs.append(fork)

    def _sequence(self, sid: int, first: int, g: TokenSource, rng: random.Random, parent: int | None = None) -> Branch:
        s = self.spec
        messages = tuple(
            () if t == 1 else g.take(rng.randint(max(1, s.tool // 2), max(1, s.tool * 3 // 2)))
            for t in range(first, s.turns + 1)
        )
        pauses = tuple(min(rng.expovariate(1 / s.pause), 4 * s.pause) if s.pause > 0 else 0.0 for _ in messages)
        return Branch(sid, first, messages, pauses, parent)

    def describe(self) -> str:
        s = self.spec
        return (
            f"{s.sessions} sessions + {s.forks} forks, {s.turns} turns (system {s.system}, task {s.context}, "
            f"tool outputs ~{s.tool}, answer {s.answer}, pauses ~{s.pause:g} s), {s.concurrency} in flight; "
            f"longest {self.longest()} tokens"
        )

    def _length(self, seq: Branch) -> int:
        own = sum(len(m) for m in seq.messages) + len(seq.messages) * self.spec.answer
        if seq.parent is None:
            return len(self.openings[seq.id]) + own
        at = self.fork_at[seq.id]
        parent = self.seqs[seq.parent]
        return len(self.openings[seq.parent]) + sum(len(m) for m in parent.messages[:at]) + at * self.spec.answer + own

    def longest(self) -> int:
        return max(self._length(q) for q in self.seqs)

    def limit_blocks(self, block_size: int) -> int:
        return len(self.seqs) * blocks(self.longest(), block_size)

    def settings(self) -> dict:
        return {k: getattr(self.spec, k) for k in self.spec.__slots__} | {"fork_at": self.fork_at}

    @staticmethod
    def _hint(seq: Branch, k: int) -> dict:
        last = k == len(seq.messages) - 1
        return session_params(f"agent-{seq.id}", continues=not last, resume_in_s=None if last else seq.pauses[k + 1])

    def run(self, server: OpenAIServer, between: Between | None = None, hints: bool = False) -> WorkloadRun:
        """Every sequence in a thread of its own (``between`` is unused: no restarts here).
        ``hints``: each request names its session (a fork is a session of its own), says
        whether another turn follows and, when one does, the pause before it."""
        slots, lock, run = threading.Semaphore(self.spec.concurrency), threading.Lock(), WorkloadRun()
        ready: dict[int, tuple[threading.Event, list[Tokens | None]]] = {
            q.id: (threading.Event(), [None]) for q in self.seqs if q.parent is not None
        }

        def start(seq: Branch) -> Tokens | None:
            if seq.parent is None:
                return self.openings[seq.id]
            event, box = ready[seq.id]
            event.wait()
            return box[0]

        def go(seq: Branch) -> None:
            history = start(seq)
            mine = [f for f in self.seqs if f.parent == seq.id]
            try:
                for k, message in enumerate(seq.messages if history is not None else ()):
                    time.sleep(seq.pauses[k])
                    prompt = (history or ()) + message
                    extra = {"kv_transfer_params": self._hint(seq, k)} if hints else {}
                    with slots:
                        out = server.stream(prompt, max_tokens=self.spec.answer, **extra)
                    with lock:
                        run.turns.append(Turn(seq.id, seq.first + k, out))
                    history = prompt + out.token_ids
                    for f in mine:
                        if self.fork_at[f.id] == seq.first + k:
                            ready[f.id][1][0] = history
                            ready[f.id][0].set()
            finally:
                for f in mine:  # a failed parent lets its forks end (with nothing to send)
                    ready[f.id][0].set()

        with ThreadPoolExecutor(len(self.seqs)) as pool:
            futures = [pool.submit(go, q) for q in self.seqs]
            for fut in futures:
                fut.result()
        return finished(run)
