"""``kvstore bench e2e``: time to first token on a real vLLM engine, ours beside its peers.

Runs on the host and never imports vLLM: every setup runs the same workload in a fresh
engine process (`harness.kit.run_engine`: one request at a time, vLLM prefix caching off,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, vLLM's default multi-process mode unless
``--single-process``), so only the connector differs between setups:

  none     no connector: the miss reference and the correctness reference
  none-pc  no connector, vLLM prefix caching on: repeats are local hits (KV never left the
           engine), the second correctness reference (see `oracle.check_outputs`)
  ours-1   our connector, engine 1 on an empty SSD dir: first sends miss (and save),
           repeats hit the host tier
  ours-2   our connector, engine 2 (a new process) on the same SSD dir, its files dropped
           from the page cache: first sends are SSD hits (prefetched to host, then
           loaded), repeats host hits
  example  vLLM's ExampleConnector on an empty dir: first sends save, repeats hit
  lmcache  LMCache 0.5.6 in multiprocess mode, its server started here; installed into this
           interpreter's venv on first use. A failure to install, start or run it is
           printed with the error tail and the bench goes on without it.

Workload ("pairs"): N distinct long prompts, each sent twice in a row, with short unrelated
prompts in between. Every ratio is to the no-connector miss TTFT of the same long prompts
(all of its sends, first and repeat, are misses), measured in the same run.

More workloads (``--scenarios``): "restart" (prompts sharing a long prefix, stored by one
engine process and repeated by a new one, beside ExampleConnector and the one-block compute
floor) and "throttled" (a Redis tier behind a bandwidth-limited link: recompute while it is
slow, hits again once it recovers), in ``harness.bench_e2e.scenarios``; "chat" (turns
hitting through earlier answers) and "tp2" (TP=2 and TP=1 engines on the same objects), in
``harness.bench_e2e.chat_tp``.

The default model is "bench-f32" (Llama-3.2-1B's KV geometry in float32) on CPUs without
AVX512-BF16, where bf16 prefill is about 16x slower, else "bench" (bf16).  The scenarios run
the float32 twin of the model (see ``scenarios``), whose outputs are checked sharply against
recompute; ``--scenario-dtype model`` runs them on the model itself (bf16 on "bench") for
their timings, and then a scenario whose outputs differ from recompute is reported, not
failed (bf16 KV computed after a prefix hit is not bit-equal to one whole prefill).  Every
row names its dtype.

Here: the command (``run``, and ``register`` for the ``kvstore.bench`` entry point).  The
setups and the workload are in ``setups``, one pass over them in ``passes``, the
correctness oracle in ``oracle``, the LMCache peer in ``lmcache_peer``, the rows and
summaries in ``report``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import tinymodel
from harness.bench_e2e.chat_tp import chat_rows, tp2_rows
from harness.bench_e2e.passes import run_pass
from harness.bench_e2e.report import build_rows, format_summary, summary
from harness.bench_e2e.scenarios import restart_rows, throttled_rows
from harness.bench_e2e.setups import build_workload
from kvstore.bench.common import print_rows, write_plot


def run(args) -> int:
    t0 = time.perf_counter()
    geo = tinymodel.GEOMETRIES[args.geometry]
    model_dir = Path(args.model_dir or Path.home() / ".cache/kvstore/models" / args.geometry)
    model = tinymodel.build_named(model_dir.expanduser(), args.geometry)
    wl = build_workload(args.prompts, args.prompt_len, args.shorts, geo.vocab)
    print(
        f"kvstore bench e2e: model {args.geometry} at {model}; {args.prompts} prompts of "
        f"{args.prompt_len} tokens sent twice, {min(args.shorts, args.prompts)} short; "
        f"{args.repeats} pass(es)",
        flush=True,
    )
    passes, summaries, extra_rows, extra = [], [], [], {}
    scenarios = _scenarios(args.scenarios)
    dtype = geo.dtype
    if scenarios & {"restart", "throttled", "chat", "tp2"}:
        twin = F32_TWIN.get(args.geometry, args.geometry) if args.scenario_dtype == "float32" else args.geometry
        sgeo = tinymodel.GEOMETRIES[twin]
        smodel = tinymodel.build_named(model_dir.expanduser().parent / twin, twin)
        print(
            f"scenarios {', '.join(sorted(scenarios - {'pairs'}))}: model {twin} ({sgeo.dtype}) at {smodel}", flush=True
        )
    runners = {"restart": restart_rows, "throttled": throttled_rows, "chat": chat_rows, "tp2": tp2_rows}
    for name, fn in runners.items():
        if name in scenarios:
            print(f"\nscenario {name}", flush=True)
            with _workdir(args.workdir, name) as work:
                rows, extra[name] = fn(smodel, sgeo.vocab, work, args, sgeo.dtype)
            extra_rows += rows
    for i in range(args.repeats if "pairs" in scenarios else 0):
        print(f"\npass {i + 1}/{args.repeats}", flush=True)
        with _workdir(args.workdir, i) as work:
            outs = run_pass(model, wl, work, args)
        passes.append(outs)
        summaries.append({k: summary(o, args.prompts) for k, o in outs.items()})
        for key, d in summaries[-1].items():
            print(format_summary(key, d), flush=True)
    rows = build_rows(passes) + extra_rows
    elapsed = time.perf_counter() - t0
    title = (
        f"kvstore bench e2e ({args.geometry}, {dtype}; TTFT p50 over {args.prompts} prompts x "
        f"{args.repeats} pass(es); limits measured in this run; {elapsed:.0f} s)"
    )
    print_rows(title, rows)
    write_plot(args.plot, title, rows)
    if args.json:
        doc = {
            "rows": [r.as_dict() for r in rows],
            "passes": summaries,
            "scenarios": extra,
            "elapsed_s": elapsed,
            "dtype": dtype,
            "workload": {
                "geometry": args.geometry,
                "prompts": args.prompts,
                "prompt_len": args.prompt_len,
                "shorts": args.shorts,
            },
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    sharp = not extra or sgeo.dtype == "float32"  # only float32 outputs are checked sharply (module docstring)
    return 0 if _ours_ok(summaries) and all(d["outputs_match"] or not sharp for d in extra.values()) else 1


def _ours_ok(summaries: list[dict]) -> bool:
    """The reference and both of our engines ran, and ours matched the reference."""
    return all(
        s.get(k, {}).get("ran") and s[k].get("outputs_match", True)
        for s in summaries
        for k in ("none", "ours-1", "ours-2")
    )


SCENARIOS = ("pairs", "restart", "throttled", "chat", "tp2")
F32_TWIN = {"bench": "bench-f32", "tiny": "tiny-f32"}  # the scenarios' sharp-oracle model


def _scenarios(text: str) -> set[str]:
    from kvstore.errors import ConfigError

    names = {n.strip() for n in text.split(",") if n.strip()}
    if not names or names - set(SCENARIOS):
        raise ConfigError(f"--scenarios: give some of {', '.join(SCENARIOS)}, comma-separated; got {text!r}")
    return names


def default_geometry() -> str:
    """float32 where the CPU lacks AVX512-BF16 (bf16 prefill is ~16x slower there)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "bench"
    return "bench" if "avx512_bf16" in flags else "bench-f32"


@contextmanager
def _workdir(root: str | None, i: int | str) -> Iterator[Path]:
    if root is None:
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-e2e-") as tmp:
            yield Path(tmp)
        return
    work = Path(root) / (f"pass-{i + 1}" if isinstance(i, int) else i)
    if work.exists():  # engine 1 must start on an empty SSD dir
        from kvstore.errors import ConfigError

        raise ConfigError(f"--workdir: {work} exists; give an empty or new directory")
    work.mkdir(parents=True)
    yield work


def register(suites) -> None:
    """``kvstore bench e2e`` (a ``kvstore.bench`` entry point)."""
    from harness.tinymodel import GEOMETRIES  # no torch/vLLM import at parse time
    from kvstore.cli.bench import positive

    p = suites.add_parser("e2e", help="TTFT on a real vLLM engine: ours, ExampleConnector, LMCache")
    p.add_argument("--json", help="write rows and per-setup results as JSON to this file")
    p.add_argument("--plot", metavar="FILE.png", help="draw each row beside its same-run limit")
    p.add_argument(
        "--geometry",
        default=default_geometry(),
        choices=sorted(GEOMETRIES),
        help="model shape (default: bench-f32 on CPUs without AVX512-BF16, else bench)",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated: pairs (each prompt twice), restart (store, restart, repeat), "
        "throttled (a slow Redis link, then recovered), chat (turns through earlier "
        "answers), tp2 (tensor parallelism: TP=2 and TP=1 on the same objects)",
    )
    p.add_argument(
        "--scenario-dtype",
        choices=("float32", "model"),
        default="float32",
        help="the scenarios' model: the float32 twin of --geometry (default; outputs checked sharply) "
        "or the model itself (its dtype, bf16 for bench: timings, outputs reported only)",
    )
    p.add_argument("--chat-turns", type=positive, default=3, help="chat: turns")
    p.add_argument("--chat-first", type=positive, default=1000, help="chat: tokens of the first prompt")
    p.add_argument("--chat-message", type=positive, default=50, help="chat: tokens of each later message")
    p.add_argument("--chat-answer", type=positive, default=300, help="chat: generated tokens per answer")
    p.add_argument("--chunk-size", type=positive, help="our connector's chunk_size (default: its own)")
    p.add_argument("--restart-prompts", type=positive, default=4, help="restart: prompts")
    p.add_argument("--restart-len", type=positive, default=2000, help="restart and throttled: tokens per prompt")
    p.add_argument("--restart-shared", type=int, default=1500, help="restart: tokens the prompts share")
    p.add_argument(
        "--throttle-prompts",
        type=positive,
        default=3,
        help="throttled: prompts while slow (three times as many after the lift)",
    )
    p.add_argument("--throttle-rate", type=float, default=4e6, help="throttled: bytes/s from Redis while slow")
    p.add_argument(
        "--explore-after",
        type=float,
        default=1.0,
        help="throttled: our explore_after_s (how soon a tier not measured since is re-measured)",
    )
    p.add_argument("--model-dir", help="where the model is built (default ~/.cache/kvstore/models/GEOMETRY)")
    p.add_argument("--repeats", type=positive, default=1, help="whole comparisons; samples pooled")
    p.add_argument("--prompts", type=positive, default=8, help="distinct long prompts")
    p.add_argument("--prompt-len", type=positive, default=2080, help="tokens per long prompt")
    p.add_argument("--shorts", type=int, default=3, help="short unrelated prompts in between")
    p.add_argument("--max-tokens", type=positive, default=8, help="generated tokens per request")
    p.add_argument("--skip-lmcache", action="store_true", help="leave out the LMCache setup")
    p.add_argument(
        "--single-process", action="store_true", help="engines in single-process mode: faster start, no LMCache"
    )
    p.add_argument("--workdir", help="keep SSD files, stats and logs here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    p.set_defaults(func=run)
