"""``kvstore bench serve``: vLLM's OpenAI server under a multi-session load, beside its limits.

Runs on the host and never imports vLLM: each setup (``harness.bench_serve.setups``: none,
ours, example, limit) is one ``harness.openai_server.OpenAIServer`` started alone, sent the
identical workload, then stopped.  Workload ``chat`` (``workload``): sessions sharing a
system prompt, each with its own context, several turns of new user tokens and a streamed
greedy answer; turn t of every session before any turn t+1, ``--concurrency`` requests in
flight, engine KV capped with ``--num-gpu-blocks-override`` (prefix caching on), our
connector with a host-DRAM budget smaller than the working set and an SSD behind it.
``--restart-after T`` restarts every setup's server after turn T (ours must then hit its SSD).

Rows (``report``): later-turn (turn >= 2) TTFT p50/p99 and output tokens/s of each setup,
beside the limit's (no connector, KV for every session) and beside no connector's, measured
in the same run; hit tokens by source/tier and our load decisions (/metrics); and whether
every output equals the connector-less server's.  Exit status 1 if any output differed or
a setup other than a peer (``example``) failed; a peer's failure is printed with its error.

Here: the command (``run``, ``main`` for a direct call, ``register`` for the ``kvstore.bench``
entry point).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from harness import kit, tinymodel
from harness.bench_serve.report import REFERENCE, build_rows, format_summary, summary
from harness.bench_serve.setups import SETUPS, Capacity, run_setup
from harness.bench_serve.workload import ChatSpec, chat_sessions
from kvstore.bench.common import print_rows, write_plot

ORDER = ("none", "ours", "example", "limit")  # the reference first: the others compare to it
PEERS = ("example",)  # a peer that fails to run is reported, not our failure; a wrong output is


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    keys = _setups(args.setups)
    geo = tinymodel.GEOMETRIES[args.geometry]
    model_dir = Path(args.model_dir or Path.home() / ".cache/kvstore/models" / args.geometry).expanduser()
    model = tinymodel.build_named(model_dir, args.geometry)
    spec = ChatSpec(args.sessions, args.turns, args.system, args.context, args.message, args.answer,
                    args.concurrency, args.seed)
    cap = Capacity(args.block_size, args.blocks, args.host_capacity, args.max_model_len or _model_len(spec, args))
    sessions = chat_sessions(spec, geo.vocab)
    print(f"kvstore bench serve chat: model {args.geometry} ({geo.dtype}); {spec.sessions} sessions x "
          f"{spec.turns} turns (system {spec.system}, context {spec.context}, message {spec.message}, "
          f"answer {spec.answer}), {spec.concurrency} in flight; engine KV {cap.blocks} blocks of "
          f"{cap.block_size} (limit: {cap.limit_blocks(spec)}); host budget {cap.host_capacity}", flush=True)
    tol = kit.LOGPROB_TOL.get(geo.dtype, kit.DEFAULT_LOGPROB_TOL)
    runs, summaries = {}, {}
    work_root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-"))
    for key in keys:
        print(f"\nsetup {key}: {SETUPS[key]}", flush=True)
        runs[key] = run_setup(key, model, work_root, cap, spec, sessions, args.restart_after)
        summaries[key] = summary(runs[key], runs.get(REFERENCE) if key != REFERENCE else None, tol)
        print(format_summary(key, summaries[key], summaries), flush=True)
    rows = build_rows(summaries)
    elapsed = time.perf_counter() - t0
    title = (f"kvstore bench serve chat ({args.geometry}; {spec.sessions} sessions x {spec.turns} turns, "
             f"{spec.concurrency} in flight; limits measured in this run; {elapsed:.0f} s)")
    print_rows(title, rows)
    write_plot(args.plot, title, rows)
    if args.json:
        doc = {"rows": [r.as_dict() for r in rows], "setups": summaries, "elapsed_s": elapsed,
               "workload": {"name": "chat", **{k: getattr(spec, k) for k in spec.__slots__}},
               "capacity": {k: getattr(cap, k) for k in cap.__slots__}, "workdir": str(work_root)}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    ok = all(d["ran"] and d.get("outputs_match", True) for k, d in summaries.items() if k not in PEERS)
    peers_ok = all(d.get("outputs_match", True) for k, d in summaries.items() if k in PEERS)
    return 0 if ok and peers_ok and REFERENCE in summaries else 1


def _model_len(spec: ChatSpec, args: argparse.Namespace) -> int:
    """The longest sequence, rounded up to whole blocks (vLLM refuses a max length the capped
    KV cannot hold)."""
    return -(-spec.longest() // args.block_size) * args.block_size


def _setups(text: str) -> list[str]:
    from kvstore.errors import ConfigError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if REFERENCE not in names or set(names) - set(SETUPS):
        raise ConfigError(f"--setups: give {REFERENCE} and any of {', '.join(SETUPS)}, comma-separated; "
                          f"got {text!r}")
    return [k for k in ORDER if k in names]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from harness.tinymodel import GEOMETRIES
    from kvstore.cli.bench import positive

    p.add_argument("--json", help="write rows and per-setup results as JSON to this file")
    p.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    p.add_argument("--setups", default="none,ours,example,limit",
                   help=f"comma-separated, {REFERENCE} required: " + "; ".join(f"{k}: {v}" for k, v in SETUPS.items()))
    p.add_argument("--geometry", default="tiny-f32", choices=sorted(GEOMETRIES), help="model shape")
    p.add_argument("--model-dir", help="where the model is built (default ~/.cache/kvstore/models/GEOMETRY)")
    p.add_argument("--sessions", type=positive, default=16, help="chat sessions")
    p.add_argument("--turns", type=positive, default=4, help="turns per session")
    p.add_argument("--system", type=positive, default=700, help="tokens of the shared system prompt")
    p.add_argument("--context", type=positive, default=500, help="tokens of each session's own context")
    p.add_argument("--message", type=positive, default=60, help="new user tokens per turn")
    p.add_argument("--answer", type=positive, default=24, help="generated tokens per turn")
    p.add_argument("--concurrency", type=positive, default=4, help="streamed requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    p.add_argument("--blocks", type=positive, default=40, help="capped engine KV, in blocks")
    p.add_argument("--block-size", type=positive, default=128, help="tokens per engine block")
    p.add_argument("--host-capacity", default="32MiB", help="our connector's host-DRAM budget (SSD behind it)")
    p.add_argument("--max-model-len", type=positive, help="vLLM --max-model-len (default: the longest session)")
    p.add_argument("--restart-after", type=positive, help="restart each setup's server after this turn")
    p.add_argument("--workdir", help="keep SSD files, stats and logs here (default: a temp dir, kept)")


def register(suites) -> None:
    """``kvstore bench serve`` (a ``kvstore.bench`` entry point)."""
    p = suites.add_parser("serve", help="vLLM's OpenAI server under multi-session load, beside its limits")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``kvstore bench serve ARGS`` without the entry point (tests; an un-reinstalled venv)."""
    p = argparse.ArgumentParser(prog="kvstore bench serve")
    add_arguments(p)
    return run(p.parse_args(argv))
