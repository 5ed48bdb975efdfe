"""The main job (``make run``): a real vLLM engine with the connector on the embedded default.

1. Build a small random-weight model locally (first run only; no hub access).
2. Run the prefix-sharing workload without a connector: the recompute reference.
3. Run it with the connector in engine process 1 (cold store: chunks are saved, and
   repeated prefixes hit host DRAM), then in engine process 2 on the same lower tiers
   (a cold host pool: hits are read from a lower tier).
4. Print TTFT p50/p95/p99 of misses and hits, hit rates with their denominators, bytes per
   tier, and whether every output matched the reference (greedy tokens and logprobs).

The lower tiers are, by default, an SSD directory (the embedded default: no Redis, no
server).  ``--store-target HOST:PORT`` adds a ``kvstore serve`` store process shared by
both engines, ``--redis-url`` a Redis tier, and ``--no-ssd`` leaves the SSD out, so that
engine 2 can only hit what engine 1 left in the shared store (the docker-compose engine).
``--pause-before LABEL --barrier-dir DIR`` stops engine 2 before that request until a test
opens the barrier (it kills the store there: the rest must be recomputed, and still match).

Exit status 0 only when outputs matched, engine 2 served hits from a lower tier, and each
engine's per-tier hit tokens sum exactly to its hit tokens.  ``--trace`` writes each
connector engine's stage trace; ``--kv-events ENDPOINT`` has them publish KV events
through vLLM's own publisher.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from harness import kit, tinymodel
from kvstore.config import redact_url
from kvstore.layout import format_bytes

CONNECTOR = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both"}


LOWER = ("ssd", "remote", "redis")


def connector_config(ssd_dir: Path | None, stats: Path, **extra: object) -> dict:
    cfg = {"ssd_dir": str(ssd_dir or ""), "host_capacity": "1GiB", "stats_path": str(stats), **extra}
    return {**CONNECTOR, "kv_connector_extra_config": cfg}


def lower_hit_tokens(stats: dict) -> dict[str, int]:
    return {t: n for t, n in stats["tokens_hit_by_tier"].items() if t in LOWER and n > 0}


def log_entries(result: kit.EngineResult, stats: dict) -> dict[str, dict]:
    """The connector's log entry of each request (vLLM suffixes the id it gave the user)."""
    by_id = {e.get("req_id", "").rsplit("-", 1)[0]: e for e in stats["recent"]}
    return {r.label: by_id[r.request_id] for r in result.requests if r.request_id in by_id}


def hit_labels(result: kit.EngineResult, stats: dict) -> set[str]:
    """Labels of requests the connector actually served from the store (its own log)."""
    return {label for label, entry in log_entries(result, stats).items() if entry["hit_tokens"] > 0}


def format_hits(result: kit.EngineResult, reference: kit.EngineResult, stats: dict) -> list[str]:
    """Each hit beside the same request's TTFT without the connector (same prompt, same run)."""
    ref, entries = reference.by_label(), log_entries(result, stats)
    lines, ratios = [], []
    for r in result.requests:
        entry = entries.get(r.label)
        if entry is None or entry["hit_tokens"] <= 0 or r.label not in ref:
            continue
        base = ref[r.label].ttft_s
        ratios.append(r.ttft_s / base)
        tiers = "+".join(f"{t} {n}" for t, n in sorted(entry["tiers"].items()))
        lines.append(
            f"    {r.label:<14} hit {entry['hit_tokens']:>5}/{r.prompt_len:<5} ({tiers}): "
            f"TTFT {r.ttft_s * 1e3:7.1f} ms vs {base * 1e3:7.1f} ms without  = {ratios[-1]:.2f}x"
        )
    if ratios:
        lines.insert(
            0,
            f"  hits beside the same request without the connector (median ratio "
            f"{kit.percentile(ratios, 50):.2f}x; below 1 is faster):",
        )
    return lines


def format_engine(
    name: str, result: kit.EngineResult, stats: dict, cmp: kit.Comparison, reference: kit.EngineResult | None = None
) -> str:
    hits = hit_labels(result, stats)
    ttft = kit.summarize(result.requests, hits)
    ms = lambda v: "   -  " if v is None else f"{v * 1e3:6.1f}"  # noqa: E731
    lines = [f"== {name}  (startup {result.startup_s:.1f} s)"]
    for kind, p in (("misses", ttft.misses), ("hits", ttft.hits)):
        lines.append(f"  TTFT {kind:<6} n={p.n:<3} p50 {ms(p.p50)} ms  p95 {ms(p.p95)} ms  p99 {ms(p.p99)} ms")
    if reference is not None:
        lines += format_hits(result, reference, stats)
    for rate in stats["rates"].values():
        lines.append(f"  {rate}")
    lines += format_provenance(stats)
    if stats.get("decisions"):
        lines.append(
            "  load-or-recompute decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(stats["decisions"].items()))
        )
    moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(stats["bytes_by_tier"].items()))
    lines.append(f"  bytes moved: {moved or 'none'}")
    if stats["failures"]:
        lines.append(f"  failures: {stats['failures']}")
    verdict = "MATCH" if cmp else "MISMATCH: " + "; ".join(cmp.mismatches[:5])
    lines.append(
        f"  outputs vs recompute: {verdict} (max logprob diff {cmp.max_logprob_diff:.2e}, tolerance {cmp.tolerance:g})"
    )
    return "\n".join(lines)


def with_barrier(workload: kit.Workload, label: str) -> kit.Workload:
    """The workload with a barrier named ``label`` before the request of that label."""
    if label not in {r.label for r in workload.requests}:
        raise SystemExit(f"harness.main: --pause-before {label}: no such request")
    return dataclasses.replace(
        workload,
        requests=tuple(dataclasses.replace(r, barrier=label) if r.label == label else r for r in workload.requests),
    )


STAGES = ("looked_up", "readable", "in_buffer", "on_device", "consumable", "gather_issued")


def tier_split_ok(stats: dict) -> bool:
    """Per-tier hit tokens sum exactly to the hit tokens, in total and for every request."""
    return sum(stats["tokens_hit_by_tier"].values()) == stats["tokens_hit"] and all(
        sum(e["tiers"].values()) == e["hit_tokens"] for e in stats["recent"]
    )


def format_provenance(stats: dict) -> list[str]:
    """The per-tier split of the hit tokens (checked against the total) and stage p50/p99."""
    hit, by_tier = stats["tokens_hit"], stats["tokens_hit_by_tier"]
    split = ", ".join(f"{t} {n} ({100.0 * n / hit:.0f}%)" for t, n in sorted(by_tier.items()) if hit) or "none"
    check = "= total" if tier_split_ok(stats) else "!= total: MISMATCH"
    lines = [f"  hit tokens by tier: {split}; sum {sum(by_tier.values())} {check} {hit}"]
    latency = stats.get("stage_latency") or {}
    shown = [f"{k} {latency[k]['p50'] * 1e3:.2f}/{latency[k]['p99'] * 1e3:.2f}" for k in STAGES if k in latency]
    if shown:
        lines.append(f"  stages p50/p99 ms (n={max(q['n'] for q in latency.values())}): " + ", ".join(shown))
    return lines


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-run-"))
    model = tinymodel.build_named(Path(args.model_dir or work / f"model-{args.geometry}"), args.geometry)
    workload = kit.Workload.standard(vocab=tinymodel.GEOMETRIES[args.geometry].vocab)
    print(
        f"model {args.geometry} at {model}; {len(workload.requests)} requests; work dir {work}; "
        f"copy device {args.device or 'auto'}",
        flush=True,
    )
    reference = kit.run_engine(model, None, workload, timeout_s=args.timeout)
    print(
        f"reference (no connector): TTFT p50 "
        f"{kit.percentiles([r.ttft_s for r in reference.requests]).p50 * 1e3:.1f} ms",
        flush=True,
    )
    ssd = None if args.no_ssd else work / "ssd"
    extra = {
        k: v
        for k, v in (
            ("store_target", args.store_target),
            ("store_token", args.store_token),
            ("store_token_file", args.store_token_file),
            ("store_tls_ca", args.store_tls_ca),
            ("redis_url", args.redis_url),
            ("device", args.device),
        )
        if v
    }
    engine_args = {}
    if args.kv_events:
        engine_args["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": args.kv_events,
            "topic": args.kv_events_topic,
        }
    tiers = ", ".join(
        [
            *(["SSD directory"] if ssd else []),
            *(
                f"{k}={redact_url(v)}"
                for k, v in extra.items()
                if k not in ("store_token", "store_token_file", "store_tls_ca", "device")
            ),
        ]
    )
    if not tiers:
        raise SystemExit("harness.main: --no-ssd needs --store-target or --redis-url (no lower tier left)")
    ok = True
    for i, name in (
        (1, "engine 1: cold store (saves; repeated prefixes hit host DRAM)"),
        (2, f"engine 2: new process, same lower tiers ({tiers}; cold host pool)"),
    ):
        stats_path = work / f"stats-{i}.json"
        paused = with_barrier(workload, args.pause_before) if i == 2 and args.pause_before else workload
        traced = {"trace_path": str(work / f"trace-{i}.json")} if args.trace else {}
        result = kit.run_engine(
            model,
            connector_config(ssd, stats_path, **extra, **traced),
            paused,
            timeout_s=args.timeout,
            engine_args=engine_args,
            barriers=args.barrier_dir and Path(args.barrier_dir),
        )
        stats = json.loads(stats_path.read_text())
        cmp = kit.compare_outputs(reference, result)
        print(format_engine(name, result, stats, cmp, reference), flush=True)
        if traced:
            print(f"  stage trace: {traced['trace_path']} (open it in https://ui.perfetto.dev)")
        ok = ok and bool(cmp) and tier_split_ok(stats)
        if i == 2:
            lower = lower_hit_tokens(stats)
            print(f"  engine 2 hit tokens from lower tiers: {lower or 'none'}")
            ok = ok and bool(lower)
    print(f"\nresult: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.main", description=__doc__.splitlines()[0])
    p.add_argument(
        "--geometry",
        default="tiny-f32",
        choices=sorted(tinymodel.GEOMETRIES),
        help="model shape; float32 tiny-f32 (default) makes the output check sharp",
    )
    p.add_argument("--workdir", help="keep models, SSD files and stats here (default: a temp dir)")
    p.add_argument("--model-dir", help="where the generated model lives (reused when present)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    p.add_argument("--store-target", help="HOST:PORT of a `kvstore serve` store process for both engines")
    p.add_argument(
        "--store-token",
        help="bearer token for the store process (visible to other users "
        "in the process list: prefer --store-token-file or KVSTORE_STORE_TOKEN)",
    )
    p.add_argument("--store-token-file", help="a file whose first line is the store process's bearer token")
    p.add_argument("--store-tls-ca", help="CA certificate (PEM) of a store process that serves TLS")
    p.add_argument("--redis-url", help="a Redis tier for both engines (redis://, rediss://, redis+cluster://)")
    p.add_argument("--no-ssd", action="store_true", help="no SSD directory: engine 2 hits only the shared tiers")
    p.add_argument(
        "--trace",
        action="store_true",
        help="write each connector engine's stage trace "
        "(trace-1.json, trace-2.json in the work dir: Chrome trace-event JSON, Perfetto opens it)",
    )
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="the connector engines publish KV events through vLLM "
        "(--kv-events-config) on this ZMQ endpoint, e.g. tcp://*:5557",
    )
    p.add_argument("--kv-events-topic", default="", help="topic of those events")
    p.add_argument(
        "--device",
        help="the connector's copy device: auto (default), host, cuda, or emulated-cuda "
        "(CUDA's stream semantics on the CPU: copies land later, nothing calls back)",
    )
    p.add_argument(
        "--pause-before",
        metavar="LABEL",
        help="engine 2 waits before this request until the barrier opens (a test kills the store there)",
    )
    p.add_argument("--barrier-dir", help="where engine 2 says LABEL.ready and waits for LABEL.go")
    args = p.parse_args(argv)
    if bool(args.pause_before) != bool(args.barrier_dir):
        p.error("--pause-before and --barrier-dir go together")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
