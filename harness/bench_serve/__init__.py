"""``kvstore bench serve``: vLLM's OpenAI server under a multi-session load, beside its limits.

Runs on the host and never imports vLLM: each setup (``harness.bench_serve.setups``: none,
ours, lmcache, example, limit) is one ``harness.openai_server.OpenAIServer`` started alone,
sent the identical workloads one after the other, then stopped.  Engine KV is capped with
``--num-gpu-blocks-override`` (prefix caching on); our connector has a host-DRAM budget
smaller than the working set and an SSD behind it.  Workloads (``--workload``, comma-separated,
run in that order on each setup's server):

  chat     sessions sharing a system prompt, each with its own context, several turns of new
           user tokens and a streamed greedy answer; turn t of every session before any turn
           t+1, ``--concurrency`` requests in flight (``workload.Chat``)
  agent    long contexts grown by tool outputs, many turns, seeded pauses of varied length,
           forks sharing a parent's prefix, each session at its own pace (``agent.Agent``)
  rag      a set of documents shared by many questions, drawn in varied order and
           combination (``rag.Rag``)
  restart  chat with each setup's server restarted after turn ``--restart-after`` (default:
           half the turns); ours must then hit its SSD

Rows (``report``), per workload: later-turn (turn >= 2) TTFT p50/p99 and output tokens/s of
each setup, beside the limit's (no connector, KV for every session) and beside no
connector's, measured in the same run; hit tokens by source/tier and our load decisions
(/metrics); and whether every output equals the connector-less server's.  Exit status 1 if
any output differed or a setup other than a peer (``lmcache``, ``example``) failed; a peer's
failure is printed with its error.  ``--repeats N`` runs every setup N times (each afresh, the
setups interleaved) and reports each figure's median (``report.merge``): on a shared machine
one run of a setup can differ from the next by a quarter.

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
from harness.bench_serve.agent import Agent, AgentSpec
from harness.bench_serve.rag import Rag, RagSpec
from harness.bench_serve.report import REFERENCE, build_rows, format_summary, merge, summary
from harness.bench_serve.setups import SETUPS, Capacity, SetupRun, run_setup
from harness.bench_serve.workload import Chat, ChatSpec, Workload
from kvstore.bench.common import Row, print_rows, write_plot

ORDER = (
    "none",
    "ours",
    "ours-hints",
    "ours-lru",
    "lmcache",
    "example",
    "limit",
)  # the reference first: the others compare to it
PEERS = ("lmcache", "example")  # a peer that fails to run is reported, not our failure; a wrong output is
WORKLOADS = ("chat", "agent", "rag", "restart")
# Each workload's knobs: flag dest -> its spec field (flags left unset take the spec's default).
SHARED = ("sessions", "turns", "system", "answer", "concurrency", "seed")
KNOBS = {
    "chat": (*SHARED, "context", "message"),
    "restart": (*SHARED, "context", "message"),
    "agent": (*SHARED, "context", "tool", "forks", "pause"),
    "rag": (*SHARED, "documents", "document", "per_prompt", "message"),
}


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    keys = _setups(args.setups)
    geo = tinymodel.GEOMETRIES[args.geometry]
    workloads = make_workloads(args, geo.vocab)
    cap = Capacity.for_workloads(workloads, args.block_size, args.blocks, args.host_capacity, args.max_model_len)
    model_dir = Path(args.model_dir or Path.home() / ".cache/kvstore/models" / args.geometry).expanduser()
    model = tinymodel.build_named(model_dir, args.geometry)
    print(
        f"kvstore bench serve: model {args.geometry} ({geo.dtype}); engine KV {cap.blocks} blocks of "
        f"{cap.block_size} (limit: {cap.limit}), max model len {cap.max_model_len}; host budget "
        f"{cap.host_capacity}",
        flush=True,
    )
    for w in workloads:
        print(f"  workload {w.name}: {w.describe()}", flush=True)
    tol = kit.LOGPROB_TOL.get(geo.dtype, kit.DEFAULT_LOGPROB_TOL)
    work_root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-"))
    per_repeat: list[dict[str, dict[str, dict]]] = []
    for rep in range(args.repeats):
        # Each repeat starts every setup afresh, in the same order, so slow moments of a
        # shared machine fall on all of them; a repeat's own work folder keeps its SSD apart.
        root = work_root if args.repeats == 1 else work_root / f"repeat-{rep + 1}"
        per_repeat.append(_one_pass(keys, model, root, cap, workloads, tol, f" (repeat {rep + 1}/{args.repeats})"))
    summaries = {w.name: {k: merge([p[w.name][k] for p in per_repeat]) for k in keys} for w in workloads}
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} repeats:", flush=True)
        for w in workloads:
            for key in keys:
                print(format_summary(key, summaries[w.name][key], summaries[w.name], w.name), flush=True)
    rows: list[Row] = [row for w in workloads for row in build_rows(w.name, summaries[w.name])]
    elapsed = time.perf_counter() - t0
    measured = "limits measured in this run" if args.repeats == 1 else f"medians of {args.repeats} repeats"
    title = (
        f"kvstore bench serve {','.join(w.name for w in workloads)} ({args.geometry}; engine KV {cap.blocks} "
        f"blocks, host {cap.host_capacity}; {measured}; {elapsed:.0f} s)"
    )
    print_rows(title, rows)
    write_plot(args.plot, title, rows)
    if args.json:
        doc = {
            "rows": [r.as_dict() for r in rows],
            "elapsed_s": elapsed,
            "workdir": str(work_root),
            "capacity": {k: getattr(cap, k) for k in cap.__slots__},
            "workloads": {w.name: {"settings": w.settings(), "setups": summaries[w.name]} for w in workloads},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0 if all(_ok(s) for s in summaries.values()) else 1


def _one_pass(
    keys: list[str], model: Path, root: Path, cap: Capacity, workloads: list[Workload], tol: float, tag: str
) -> dict[str, dict[str, dict]]:
    """Every setup through every workload once: the summaries, by workload then setup."""
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, SetupRun]] = {w.name: {} for w in workloads}
    summaries: dict[str, dict[str, dict]] = {w.name: {} for w in workloads}
    for key in keys:
        print(f"\nsetup {key}{tag}: {SETUPS[key]}", flush=True)
        for w, r in zip(workloads, run_setup(key, model, root, cap, workloads), strict=True):
            runs[w.name][key] = r
            ref = runs[w.name].get(REFERENCE) if key != REFERENCE else None
            summaries[w.name][key] = summary(r, ref, tol)
            print(format_summary(key, summaries[w.name][key], summaries[w.name], w.name), flush=True)
    return summaries


def _ok(summaries: dict[str, dict]) -> bool:
    ours = all(d["ran"] and d.get("outputs_match", True) for k, d in summaries.items() if k not in PEERS)
    peers = all(d.get("outputs_match", True) for k, d in summaries.items() if k in PEERS)
    return ours and peers and REFERENCE in summaries


def make_workloads(args: argparse.Namespace, vocab: int) -> list[Workload]:
    """The ``--workload`` list, each with its knobs; a bad name or setting is a ``ConfigError``."""
    from kvstore.errors import ConfigError

    names = _names(args.workload or ("restart" if args.restart_after else "chat"), WORKLOADS, "--workload")
    if args.restart_after and "restart" not in names:
        raise ConfigError("--restart-after is the restart workload's knob: add restart to --workload")
    out: list[Workload] = []
    for name in names:
        spec_type = {"chat": ChatSpec, "restart": ChatSpec, "agent": AgentSpec, "rag": RagSpec}[name]
        spec = spec_type(**{k: getattr(args, k) for k in KNOBS[name] if getattr(args, k) is not None})
        if name == "agent":
            out.append(Agent(spec, vocab))
        elif name == "rag":
            out.append(Rag(spec, vocab))
        else:
            out.append(Chat(spec, vocab, _restart_after(spec, args.restart_after) if name == "restart" else None))
    return out


def _restart_after(spec: ChatSpec, turn: int | None) -> int:
    from kvstore.errors import ConfigError

    if spec.turns < 2:
        raise ConfigError(f"workload restart: --turns {spec.turns} leaves no turn after a restart (give >= 2)")
    turn = turn or spec.turns // 2
    if turn >= spec.turns:
        raise ConfigError(f"--restart-after {turn}: give a turn before the last (--turns {spec.turns})")
    return turn


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    from kvstore.errors import ConfigError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(known) or len(set(names)) != len(names):
        raise ConfigError(f"{flag}: give any of {', '.join(known)}, comma-separated, each once; got {text!r}")
    return names


def _setups(text: str) -> list[str]:
    from kvstore.errors import ConfigError

    names = _names(text, tuple(SETUPS), "--setups")
    if REFERENCE not in names:
        raise ConfigError(f"--setups: give {REFERENCE} (every output is checked against it); got {text!r}")
    return [k for k in ORDER if k in names]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from harness.tinymodel import GEOMETRIES
    from kvstore.cli.bench import positive

    p.add_argument("--json", help="write rows and per-setup results as JSON to this file")
    p.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    p.add_argument(
        "--setups",
        default="none,ours,lmcache,example,limit",
        help=f"comma-separated, {REFERENCE} required: " + "; ".join(f"{k}: {v}" for k, v in SETUPS.items()),
    )
    p.add_argument(
        "--workload",
        help=f"comma-separated, run in this order on each setup's server: any of "
        f"{', '.join(WORKLOADS)} (default chat; restart if --restart-after is given)",
    )
    p.add_argument("--geometry", default="tiny-f32", choices=sorted(GEOMETRIES), help="model shape")
    p.add_argument("--model-dir", help="where the model is built (default ~/.cache/kvstore/models/GEOMETRY)")
    g = p.add_argument_group("workload knobs (unset: each workload's default, docs/bench-serve.md)")
    g.add_argument("--sessions", type=positive, help="sessions (rag: users) [chat 16, agent 8, rag 16]")
    g.add_argument("--turns", type=positive, help="turns per session (rag: rounds) [chat 4, agent 8, rag 3]")
    g.add_argument("--system", type=positive, help="tokens of the shared system prompt [chat 700, agent 512, rag 128]")
    g.add_argument("--context", type=positive, help="tokens of a session's own context or task [chat 500, agent 256]")
    g.add_argument("--message", type=positive, help="new user tokens per turn, rag: per question [chat 60, rag 32]")
    g.add_argument("--answer", type=positive, help="generated tokens per turn [chat 24, agent 16, rag 16]")
    g.add_argument("--concurrency", type=positive, help="streamed requests in flight [4]")
    g.add_argument("--seed", type=int, help="seed of the token ids, lengths, pauses and draws [0]")
    g.add_argument("--tool", type=positive, help="agent: mean tokens of a tool output [128]")
    g.add_argument("--forks", type=int, help="agent: sub-sessions sharing a parent's prefix [4]")
    g.add_argument("--pause", type=float, help="agent: mean seconds between a session's turns [0.5]")
    g.add_argument("--documents", type=positive, help="rag: documents in the shared set [12]")
    g.add_argument("--document", type=positive, help="rag: tokens per document [256]")
    g.add_argument("--per-prompt", type=positive, help="rag: documents per question [3]")
    g.add_argument("--restart-after", type=positive, help="restart: restart each server after this turn [turns/2]")
    p.add_argument("--blocks", type=positive, default=40, help="capped engine KV, in blocks")
    p.add_argument("--block-size", type=positive, default=128, help="tokens per engine block")
    p.add_argument("--host-capacity", default="32MiB", help="our connector's host-DRAM budget (SSD behind it)")
    p.add_argument("--max-model-len", type=positive, help="vLLM --max-model-len (default: the longest sequence)")
    p.add_argument("--workdir", help="keep SSD files, stats and logs here (default: a temp dir, kept)")
    p.add_argument(
        "--repeats",
        type=positive,
        default=1,
        help="run every setup this many times (each afresh, setups interleaved) and report the median of each "
        "figure; every repeat's outputs are checked",
    )


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
