"""The main job (``make run``): a real vLLM engine with the connector on the embedded default.

1. Build a small random-weight model locally (first run only; no hub access).
2. Run the prefix-sharing workload without a connector: the recompute reference.
3. Run it with the connector in engine process 1 (cold store: chunks are saved, and
   repeated prefixes hit host DRAM), then in engine process 2 on the same SSD directory
   (a cold host pool: hits are read from SSD).
4. Print TTFT p50/p95/p99 of misses and hits, hit rates with their denominators, bytes per
   tier, and whether every output matched the reference (greedy tokens and logprobs).

Exit status 0 only when outputs matched and engine 2 served hits from SSD.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from connector import e2e, tinymodel
from kvstore.layout import format_bytes

CONNECTOR = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm",
             "kv_role": "kv_both"}


def connector_config(ssd_dir: Path, stats: Path, **extra: object) -> dict:
    cfg = {"ssd_dir": str(ssd_dir), "host_capacity": "1GiB", "stats_path": str(stats), **extra}
    return {**CONNECTOR, "kv_connector_extra_config": cfg}


def hit_labels(result: e2e.EngineResult, stats: dict) -> set[str]:
    """Labels of requests the connector actually served from the store (its own log)."""
    log = stats["recent"][-len(result.requests):]
    return {r.label for r, entry in zip(result.requests, log) if entry["hit_tokens"] > 0}


def format_engine(name: str, result: e2e.EngineResult, stats: dict, cmp: e2e.Comparison) -> str:
    hits = hit_labels(result, stats)
    ttft = e2e.summarize(result.requests, hits)
    ms = lambda v: "   -  " if v is None else f"{v * 1e3:6.1f}"  # noqa: E731
    lines = [f"== {name}  (startup {result.startup_s:.1f} s)"]
    for kind, p in (("misses", ttft.misses), ("hits", ttft.hits)):
        lines.append(f"  TTFT {kind:<6} n={p.n:<3} p50 {ms(p.p50)} ms  p95 {ms(p.p95)} ms  p99 {ms(p.p99)} ms")
    for rate in stats["rates"].values():
        lines.append(f"  {rate}")
    tiers = ", ".join(f"{t} {n}" for t, n in sorted(stats["tokens_hit_by_tier"].items())) or "none"
    lines.append(f"  hit tokens by tier: {tiers}")
    moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(stats["bytes_by_tier"].items()))
    lines.append(f"  bytes moved: {moved or 'none'}")
    if stats["failures"]:
        lines.append(f"  failures: {stats['failures']}")
    verdict = "MATCH" if cmp else "MISMATCH: " + "; ".join(cmp.mismatches[:5])
    lines.append(f"  outputs vs recompute: {verdict} (max logprob diff {cmp.max_logprob_diff:.2e}, "
                 f"tolerance {cmp.tolerance:g})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-run-"))
    model = tinymodel.build_named(Path(args.model_dir or work / f"model-{args.geometry}"), args.geometry)
    workload = e2e.Workload.standard(vocab=tinymodel.GEOMETRIES[args.geometry].vocab)
    print(f"model {args.geometry} at {model}; {len(workload.requests)} requests; work dir {work}", flush=True)
    reference = e2e.run_engine(model, None, workload, timeout_s=args.timeout)
    print(f"reference (no connector): TTFT p50 "
          f"{e2e.percentiles([r.ttft_s for r in reference.requests]).p50 * 1e3:.1f} ms", flush=True)
    ok, ssd = True, work / "ssd"
    for i, name in ((1, "engine 1: cold store (saves; repeated prefixes hit host DRAM)"),
                    (2, "engine 2: new process, same SSD directory (cold host pool)")):
        stats_path = work / f"stats-{i}.json"
        result = e2e.run_engine(model, connector_config(ssd, stats_path), workload, timeout_s=args.timeout)
        stats = json.loads(stats_path.read_text())
        cmp = e2e.compare_outputs(reference, result)
        print(format_engine(name, result, stats, cmp), flush=True)
        ok = ok and bool(cmp)
        if i == 2:
            ok = ok and stats["tokens_hit_by_tier"].get("ssd", 0) > 0
    print(f"\nresult: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m connector.main", description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="tiny-f32", choices=sorted(tinymodel.GEOMETRIES),
                   help="model shape; float32 tiny-f32 (default) makes the output check sharp")
    p.add_argument("--workdir", help="keep models, SSD files and stats here (default: a temp dir)")
    p.add_argument("--model-dir", help="where the generated model lives (reused when present)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
