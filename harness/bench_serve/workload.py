"""The ``chat`` workload of ``kvstore bench serve``: interleaved multi-turn sessions, streamed.

Host side, no vLLM import.  ``chat_sessions`` makes the sessions (seeded token ids: every
setup gets the same ones): a system prompt all sessions share, then each session's own
context and one user message per turn.  ``run_chat`` sends them to one ``OpenAIServer``:
turn t of every session before any turn t+1, ``concurrency`` streamed requests in flight;
turn t+1's prompt is turn t's prompt, its answer and the next message.  Answers are greedy,
so a setup whose outputs equal the reference's was sent the reference's prompts too.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harness.kit import TokenSource
from harness.openai_server import Completion, OpenAIServer


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """The shape of the chat workload (the defaults are issue 24's)."""

    sessions: int = 16
    turns: int = 4
    system: int = 700  # tokens of the system prompt every session shares
    context: int = 500  # tokens of each session's own context
    message: int = 60  # new user tokens per turn
    answer: int = 24  # generated tokens per turn
    concurrency: int = 4  # streamed requests in flight
    seed: int = 0

    def longest(self) -> int:
        """Tokens of the longest sequence (the last turn's prompt and its answer)."""
        return self.system + self.context + self.turns * (self.message + self.answer)


@dataclass(frozen=True, slots=True)
class Session:
    opening: tuple[int, ...]  # the system prompt and this session's context
    messages: tuple[tuple[int, ...], ...]  # one user message per turn


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: which session and turn (1-based), and what came back."""

    session: int
    turn: int
    completion: Completion

    @property
    def key(self) -> tuple[int, int]:
        return (self.session, self.turn)


@dataclass(slots=True)
class ChatRun:
    turns: list[Turn] = field(default_factory=list)
    elapsed_s: float = 0.0  # serving time: the run's wall time less the time spent in ``between``


def chat_sessions(spec: ChatSpec, vocab: int) -> list[Session]:
    g = TokenSource(spec.seed, vocab)
    system = g.take(spec.system)
    return [Session(system + g.take(spec.context), tuple(g.take(spec.message) for _ in range(spec.turns)))
            for _ in range(spec.sessions)]


def run_chat(server: OpenAIServer, sessions: list[Session], spec: ChatSpec,
             between: Callable[[int], None] | None = None) -> ChatRun:
    """Every session's turns, interleaved; ``between(t)`` runs after turn t (a restart)."""
    import time

    history = [s.opening for s in sessions]
    run = ChatRun()
    t0 = time.monotonic()
    with ThreadPoolExecutor(spec.concurrency) as pool:
        for t in range(spec.turns):
            prompts = [history[i] + s.messages[t] for i, s in enumerate(sessions)]
            outs = list(pool.map(lambda p: server.stream(p, max_tokens=spec.answer), prompts))
            for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
                run.turns.append(Turn(i, t + 1, out))
                history[i] = prompt + out.token_ids
            if between is not None and t + 1 < spec.turns:
                paused = time.monotonic()
                between(t + 1)
                t0 += time.monotonic() - paused
    run.elapsed_s = time.monotonic() - t0
    return run
