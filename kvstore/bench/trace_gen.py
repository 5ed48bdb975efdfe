"""A generated request trace of another shape than Mooncake's, in its format, for
``kvstore bench trace`` (docs/bench-trace.md): 40 shared system prompts of Zipf
popularity (2–12 blocks each), interleaved chat sessions on them (1–8 blocks of their
own, then 1–7 further turns of 1–4 blocks, a turn going to one of the 30 newest live
sessions), and 15% one-shot long documents (20–120 blocks, a scan).  Requests arrive
at 4 a second (exponential gaps).  Deterministic for a seed.  Runs anywhere (no store).

    python -m kvstore.bench.trace_gen OUT.jsonl [--seed 7] [--requests 4000]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

PROMPTS = 40
DOCUMENT_SHARE = 0.15
NEW_SESSION_SHARE = 0.30


@dataclass
class _Session:
    ids: list[int]
    left: int  # turns still to come


class _Ids:
    """Fresh block ids, in order."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def chat_and_scans(requests: int = 4000, seed: int = 7) -> list[dict[str, object]]:
    """The trace's requests, as Mooncake's JSON objects (see the module docstring)."""
    rng, ids = random.Random(seed), _Ids()
    prompts = [ids.take(rng.randint(2, 12)) for _ in range(PROMPTS)]
    weights = [1 / (i + 1) ** 1.1 for i in range(PROMPTS)]
    active: list[_Session] = []
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(4.0)
        draw = rng.random()
        if draw < DOCUMENT_SHARE:
            blocks = ids.take(rng.randint(20, 120))
        elif draw < DOCUMENT_SHARE + NEW_SESSION_SHARE or not active:
            session = _Session(rng.choices(prompts, weights)[0] + ids.take(rng.randint(1, 8)), rng.randint(1, 7))
            active.append(session)
            blocks = session.ids
        else:
            session = rng.choice(active[-30:])
            session.ids = blocks = session.ids + ids.take(rng.randint(1, 4))
            session.left -= 1
            if session.left <= 0:
                active.remove(session)
        out.append(
            {
                "timestamp": int(t * 1000),
                "input_length": len(blocks) * 512 - rng.randint(0, 511),
                "output_length": 10,
                "hash_ids": blocks,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.trace_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSON-lines file to write")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args(argv)
    lines = (json.dumps(r) for r in chat_and_scans(args.requests, args.seed))
    Path(args.out).write_text("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
