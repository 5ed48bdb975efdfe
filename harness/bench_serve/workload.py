"""What every workload of ``kvstore bench serve`` shares, and the ``chat`` and ``restart`` workloads.

Host side, no vLLM import.  A workload (``Workload``) makes its seeded token ids (every setup
gets the same ones) and sends them to one ``OpenAIServer`` as streamed greedy requests; each
request is a ``Turn`` (session, turn, what came back).  Answers are greedy, so a setup whose
outputs equal the reference's was sent the reference's prompts too.  A run's serving time is
the time at least one request was in flight (``busy_s``): pauses of the workload and restarts
of the server are not serving time.

``chat`` (``Chat``): sessions sharing a system prompt, each with its own context and one user
message per turn; turn t of every session before any turn t+1 (``run_rounds``), ``concurrency``
requests in flight; turn t+1's prompt is turn t's prompt, its answer and the next message.
``restart`` is ``chat`` with the server restarted after turn ``restart_after``.  ``agent``
and ``rag`` live in ``harness.bench_serve.agent`` and ``harness.bench_serve.rag``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from harness.kit import TokenSource
from harness.openai_server import Completion, OpenAIServer

Tokens = tuple[int, ...]
Between = Callable[[int], None]  # called after round t (not after the last): a restart


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
class WorkloadRun:
    turns: list[Turn] = field(default_factory=list)
    elapsed_s: float = 0.0  # serving time: when at least one request was in flight (``busy_s``)


def busy_s(completions: Iterable[Completion]) -> float:
    """The length of the union of the requests' [sent, received] intervals."""
    total, end = 0.0, None
    for c in sorted(completions, key=lambda c: c.sent):
        if end is None or c.sent > end:
            total, end = total + c.received - c.sent, c.received
        elif c.received > end:
            total, end = total + c.received - end, c.received
    return total


def finished(run: WorkloadRun) -> WorkloadRun:
    run.elapsed_s = busy_s(t.completion for t in run.turns)
    return run


class Workload(Protocol):
    """What ``kvstore bench serve`` needs of a workload."""

    name: str
    restart_after: int | None  # restart the server after this round (``restart`` only)

    def describe(self) -> str: ...

    def longest(self) -> int:
        """Tokens of the longest sequence (a prompt and its answer)."""
        ...

    def limit_blocks(self, block_size: int) -> int:
        """Engine blocks enough to keep every sequence of the workload at once."""
        ...

    def settings(self) -> dict: ...

    def run(self, server: OpenAIServer, between: Between | None, hints: bool = False) -> WorkloadRun:
        """``hints``: send session hints in ``kv_transfer_params`` where the workload knows them."""
        ...


def session_params(name: str, continues: bool = True, resume_in_s: float | None = None) -> dict:
    """A request's session hint (``connector.sessions``) as ``kv_transfer_params``."""
    hint: dict = {"session": name, "continues": continues}
    if resume_in_s is not None:
        hint["resume_in_s"] = round(resume_in_s, 3)
    return {"kvstore": hint}


def blocks(tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``tokens`` takes, and a spare."""
    return -(-tokens // block_size) + 1


def run_rounds(
    server: OpenAIServer,
    rounds: int,
    prompts_of: Callable[[int], Sequence[tuple[int, Tokens]]],
    answer: int,
    concurrency: int,
    between: Between | None = None,
    after: Callable[[int, Tokens, Completion], None] | None = None,
    params_of: Callable[[int, int], dict] | None = None,
) -> WorkloadRun:
    """Round t's (session, prompt) pairs, ``concurrency`` streamed requests in flight, all
    answered before round t+1's prompts are made; ``after`` sees each answer, ``between(t)``
    runs after every round but the last; ``params_of(session, t)``: the request's
    ``kv_transfer_params`` (session hints)."""
    run = WorkloadRun()

    def send(item: tuple[int, Tokens], t: int) -> Completion:
        extra = {} if params_of is None else {"kv_transfer_params": params_of(item[0], t)}
        return server.stream(item[1], max_tokens=answer, **extra)

    with ThreadPoolExecutor(concurrency) as pool:
        for t in range(1, rounds + 1):
            items = list(prompts_of(t))
            outs = list(pool.map(lambda item, t=t: send(item, t), items))
            for (i, prompt), out in zip(items, outs, strict=True):
                run.turns.append(Turn(i, t, out))
                if after is not None:
                    after(i, prompt, out)
            if between is not None and t < rounds:
                between(t)
    return finished(run)


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
    opening: Tokens  # the system prompt and this session's context
    messages: tuple[Tokens, ...]  # one user message per turn


def chat_sessions(spec: ChatSpec, vocab: int) -> list[Session]:
    g = TokenSource(spec.seed, vocab)
    system = g.take(spec.system)
    return [
        Session(system + g.take(spec.context), tuple(g.take(spec.message) for _ in range(spec.turns)))
        for _ in range(spec.sessions)
    ]


class Chat:
    """Interleaved multi-turn sessions (``restart_after``: the ``restart`` workload)."""

    def __init__(self, spec: ChatSpec, vocab: int, restart_after: int | None = None) -> None:
        self.spec, self.restart_after = spec, restart_after
        self.name = "chat" if restart_after is None else "restart"
        self.sessions = chat_sessions(spec, vocab)

    def describe(self) -> str:
        s = self.spec
        text = (
            f"{s.sessions} sessions x {s.turns} turns (system {s.system}, context {s.context}, message "
            f"{s.message}, answer {s.answer}), {s.concurrency} in flight"
        )
        return text if self.restart_after is None else text + f"; server restarted after turn {self.restart_after}"

    def longest(self) -> int:
        return self.spec.longest()

    def limit_blocks(self, block_size: int) -> int:
        return self.spec.sessions * blocks(self.spec.longest(), block_size)

    def settings(self) -> dict:
        return {"restart_after": self.restart_after, **{k: getattr(self.spec, k) for k in self.spec.__slots__}}

    def run(self, server: OpenAIServer, between: Between | None = None, hints: bool = False) -> WorkloadRun:
        """``hints``: each request names its session, and the last turn says it ends."""
        history = [s.opening for s in self.sessions]
        turns = self.spec.turns

        def prompts(t: int) -> list[tuple[int, Tokens]]:
            return [(i, history[i] + s.messages[t - 1]) for i, s in enumerate(self.sessions)]

        def after(i: int, prompt: Tokens, out: Completion) -> None:
            history[i] = prompt + out.token_ids

        def params(i: int, t: int) -> dict:
            return session_params(f"chat-{i}", continues=t < turns)

        return run_rounds(
            server, turns, prompts, self.spec.answer, self.spec.concurrency, between, after, params if hints else None
        )
