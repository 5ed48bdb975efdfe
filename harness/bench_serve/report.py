"""The figures of ``kvstore bench serve``: per-setup summaries, correctness against the
connector-less server, and rows beside the limit and beside no connector (and, when
``ours-lru`` ran, ours and ours-hints beside it: host-DRAM hit tokens and TTFT).

Host side.  Later turns are turns >= 2 (the ones a cache can serve; ``rag``'s rounds >= 2);
output tokens/s is every generated token over the serving time (the time at least one
request was in flight: restarts and the workload's pauses excluded).  Rows are per workload,
named ``WORKLOAD SETUP FIGURE``.  ``check`` compares each request's
output token ids with the ``none`` setup's (equal greedy outputs mean equal prompts, turn
after turn) and its chosen-token logprobs within ``harness.kit.LOGPROB_TOL`` of the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness import kit
from harness.bench_serve.setups import SETUPS, SetupRun
from kvstore.bench.common import Row

REFERENCE, LIMIT, LRU = "none", "limit", "ours-lru"
RETENTION = ("ours", "ours-hints")  # also shown beside ours-lru when it ran (the retention targets)
# (summary key, row name, unit, which way is better)
FIGURES = (
    ("ttft_p50_ms", "later-turn TTFT p50", "ms", "lower"),
    ("ttft_p99_ms", "later-turn TTFT p99", "ms", "lower"),
    ("output_tok_s", "output tokens/s", "tok/s", "higher"),
)
LRU_FIGURES = (("host_hit_tokens", "host-DRAM hit tokens", "tok", "higher"), *FIGURES[:2])


@dataclass(frozen=True, slots=True)
class Check:
    """One setup's outputs against the reference's, request by request."""

    compared: int
    mismatches: tuple[str, ...]
    max_logprob_diff: float

    @property
    def ok(self) -> bool:
        return self.compared > 0 and not self.mismatches


def check(run: SetupRun, reference: SetupRun, tolerance: float) -> Check:
    ref = {t.key: t.completion for t in reference.run.turns}
    bad, worst, n = [], 0.0, 0
    for t in run.run.turns:
        want = ref.get(t.key)
        n += 1
        if want is None:
            bad.append(f"session {t.session} turn {t.turn}: no reference output")
            continue
        if t.completion.token_ids != want.token_ids:
            bad.append(f"session {t.session} turn {t.turn}: tokens {t.completion.token_ids} != {want.token_ids}")
            continue
        diffs = [abs(a - b) for a, b in zip(t.completion.logprobs, want.logprobs, strict=False)]
        worst = max([worst, *diffs])
        if diffs and max(diffs) > tolerance:
            bad.append(f"session {t.session} turn {t.turn}: logprob diff {max(diffs):.2e} > {tolerance:g}")
    if len(run.run.turns) != len(ref):
        bad.append(f"{len(run.run.turns)} requests, the reference had {len(ref)}")
    return Check(n, tuple(bad), worst)


def summary(run: SetupRun, reference: SetupRun | None, tolerance: float) -> dict:
    d: dict = {"title": SETUPS[run.key], "ran": run.run is not None, "error": run.error}
    if run.run is None:
        return d
    turns = run.run.turns
    later = [t.completion.ttft_s * 1e3 for t in turns if t.turn >= 2 and t.completion.ttft_s is not None]
    out_tokens = sum(len(t.completion.token_ids) for t in turns)
    d.update(
        requests=len(turns),
        later_requests=len(later),
        startup_s=round(run.startup_s, 2),
        ttft_p50_ms=kit.percentile(later, 50),
        ttft_p99_ms=kit.percentile(later, 99),
        output_tokens=out_tokens,
        serving_s=round(run.run.elapsed_s, 3),
        output_tok_s=out_tokens / run.run.elapsed_s if run.run.elapsed_s > 0 else None,
        cached_tokens_reported=sum(t.completion.cached_tokens or 0 for t in turns if t.turn >= 2),
        host_hit_tokens=int(run.counters.get("hit_tokens_by_tier", {}).get("host", 0)),
        restarts=run.restarts,
        **{k: {n: int(v) for n, v in table.items() if v} for k, table in run.counters.items()},
    )
    if reference is not None and reference.run is not None:
        c = check(run, reference, tolerance)
        d.update(
            outputs_match=c.ok,
            compared=c.compared,
            max_logprob_diff=c.max_logprob_diff,
            mismatches=list(c.mismatches[:5]),
        )
    return d


MEDIANS = tuple(dict.fromkeys(key for key, *_ in (*FIGURES, *LRU_FIGURES)))  # merged across repeats


def merge(repeats: list[dict]) -> dict:
    """One setup's summaries of several repeats of a workload as one: each figure of
    ``MEDIANS`` the median of the repeats that measured it (each repeat's value kept under
    ``repeats``), correctness over all of them (every output of every repeat checked), the
    rest (counters, titles) as the last repeat left it."""
    if len(repeats) == 1:
        return repeats[0]
    d = dict(repeats[-1])
    d["ran"] = all(r["ran"] for r in repeats)
    d["error"] = next((r["error"] for r in repeats if r.get("error")), None)
    d["repeats"] = {key: [r.get(key) for r in repeats] for key in MEDIANS}
    for key in MEDIANS:
        values = [v for v in d["repeats"][key] if v is not None]
        d[key] = kit.percentile(values, 50) if values else None
    checked = [r for r in repeats if "outputs_match" in r]
    if checked:
        d.update(
            outputs_match=len(checked) == len(repeats) and all(r["outputs_match"] for r in checked),
            compared=sum(r["compared"] for r in checked),
            max_logprob_diff=max(r["max_logprob_diff"] for r in checked),
            mismatches=[m for r in checked for m in r["mismatches"]][:5],
        )
    return d


def build_rows(workload: str, summaries: dict[str, dict]) -> list[Row]:
    """Each setup's figures beside the limit's, and the connectors' beside no connector's,
    in one workload."""
    rows = []
    for key, name, unit, better in FIGURES:
        for base in (LIMIT, REFERENCE):
            limit = summaries.get(base, {}).get(key)
            for setup, d in summaries.items():
                value = d.get(key)
                if setup in (LIMIT, base) or value is None or limit is None:
                    continue
                rows.append(Row(f"{workload} {setup} {name}", value, unit, f"{workload} {base} {name}", limit, better))
    lru = summaries.get(LRU, {})
    for key, name, unit, better in LRU_FIGURES if lru.get("ran") else ():
        for setup in RETENTION:
            value = summaries.get(setup, {}).get(key)
            if value is not None and lru.get(key):
                rows.append(
                    Row(f"{workload} {setup} {name}", value, unit, f"{workload} {LRU} {name}", lru[key], better)
                )
    return rows


def format_summary(key: str, d: dict, summaries: dict[str, dict], workload: str = "") -> str:
    lines = [f"== {workload + ' ' if workload else ''}{key}: {d['title']}"]
    if not d["ran"]:
        first = (d["error"] or "").strip().splitlines()[-1:]
        return "\n".join(lines + [f"  did not run: {first[0] if first else '?'}"])
    parts = []
    for fig, name, unit, _ in FIGURES:
        beside = [
            f"x{d[fig] / summaries[b][fig]:.2f} {b}"
            for b in (LIMIT, REFERENCE)
            if b != key and summaries.get(b, {}).get(fig) and d.get(fig) is not None
        ]
        value = "-" if d.get(fig) is None else f"{d[fig]:.1f} {unit}"
        parts.append(f"{name} {value}" + (f" ({', '.join(beside)})" if beside else ""))
    lines.append(f"  {d['requests']} requests ({d['later_requests']} later-turn); " + "; ".join(parts))
    if "outputs_match" in d:
        verdict = "MATCH" if d["outputs_match"] else "MISMATCH: " + "; ".join(d["mismatches"])
        lines.append(
            f"  outputs vs {REFERENCE}: {verdict} ({d['compared']} compared, "
            f"max logprob diff {d['max_logprob_diff']:.2e})"
        )
    for table in ("vllm_cached_by_source", "hit_tokens_by_tier", "decisions"):
        if d.get(table):
            lines.append(f"  {table}: " + ", ".join(f"{k} {v}" for k, v in sorted(d[table].items())))
    if d["restarts"]:
        lines.append(f"  restarts: {d['restarts']}")
    return "\n".join(lines)
