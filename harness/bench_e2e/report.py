"""The figures of ``kvstore bench e2e``: rows of TTFT p50s and ratios, and per-setup summaries.

Host side.  Every ratio is to the no-connector miss TTFT (``MISS``) of the same long prompts
in the same run; ``summary`` is one setup of one pass for the JSON, ``format_summary`` prints it.
"""

from __future__ import annotations

from harness import kit
from harness import main as job
from harness.bench_e2e.setups import FIRST, REPEAT, SETUPS, SHORT, TITLES, Outcome, is_kind
from kvstore.bench.common import Row

MISS = "none miss TTFT p50"


def ttfts(passes: list[dict[str, Outcome]], key: str, kind: str) -> list[float]:
    """TTFT samples (s) of one setup and kind of send, pooled over passes."""
    return [
        r.ttft_s for p in passes if key in p and p[key].result for r in p[key].result.requests if is_kind(r.label, kind)
    ]


def p50_ms(values: list[float]) -> float | None:
    p = kit.percentile(values, 50)
    return None if p is None else p * 1e3


def build_rows(passes: list[dict[str, Outcome]]) -> list[Row]:
    miss = p50_ms(ttfts(passes, "none", FIRST) + ttfts(passes, "none", REPEAT))
    if miss is None:
        return []
    rows = []
    for key, short, _ in SETUPS:
        for kind, what in ((FIRST, "first sends"), (REPEAT, "repeats")):
            value = p50_ms(ttfts(passes, key, kind))
            if value is not None:
                rows.append(Row(f"TTFT {short}, {what}", value, "ms", MISS, miss, "lower"))
    host_hit = p50_ms(ttfts(passes, "ours-1", REPEAT))
    targets = (
        ("ours host hit TTFT / miss TTFT", host_hit, MISS, miss, 0.25),
        ("ours SSD hit TTFT / miss TTFT", p50_ms(ttfts(passes, "ours-2", FIRST)), MISS, miss, 0.5),
        (
            "ours hit vs ExampleConnector hit",
            host_hit,
            "example hit TTFT p50",
            p50_ms(ttfts(passes, "example", REPEAT)),
            1.0,
        ),
        ("ours hit vs LMCache hit", host_hit, "lmcache hit TTFT p50", p50_ms(ttfts(passes, "lmcache", REPEAT)), 1.0),
        ("connector overhead on a miss", p50_ms(ttfts(passes, "ours-1", FIRST)), MISS, miss, 1.05),
    )
    return rows + [
        Row(name, v, "ms", lname, lv, "lower", target)
        for name, v, lname, lv, target in targets
        if v is not None and lv is not None
    ]


def summary(out: Outcome, n_long: int) -> dict:
    """One setup of one pass, for printing and the JSON."""
    d: dict = {"title": TITLES[out.key], "ran": out.result is not None, "error": out.error}
    if out.result is None:
        return d
    reqs = out.result.requests
    d["startup_s"] = round(out.result.startup_s, 2)
    d["ttft_ms"] = {
        k: p50_ms([r.ttft_s for r in reqs if is_kind(r.label, kind)])
        for k, kind in (("first", FIRST), ("repeat", REPEAT), ("short", SHORT))
    }
    if out.cmp is not None:
        d.update(
            outputs_match=bool(out.cmp),
            max_logprob_diff=out.cmp.max_logprob_diff,
            mismatches=list(out.cmp.mismatches[:5]),
            kv_loaded_by_output=_counts(out.cached, n_long),
        )
    if out.stats is not None:
        d["served_from_store"] = _counts(job.hit_labels(out.result, out.stats), n_long)
        d.update(
            rates=out.stats["rates"],
            tokens_hit_by_tier=out.stats["tokens_hit_by_tier"],
            failures=out.stats.get("failures", {}),
        )
    return d


def _counts(labels, n_long: int) -> dict[str, int]:
    return {
        "first": sum(is_kind(x, FIRST) for x in labels),
        "repeat": sum(is_kind(x, REPEAT) for x in labels),
        "of": n_long,
    }


def format_summary(key: str, d: dict) -> str:
    lines = [f"== {key}: {d['title']}"]
    if not d["ran"]:
        first = (d["error"] or "").strip().splitlines()[:1]
        return "\n".join(lines + [f"  did not run: {first[0] if first else '?'}"])
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    t = d["ttft_ms"]
    lines.append(
        f"  startup {d['startup_s']:.1f} s; TTFT p50 first {ms(t['first'])}, "
        f"repeat {ms(t['repeat'])}, short {ms(t['short'])}"
    )
    if "outputs_match" in d:
        verdict = "MATCH" if d["outputs_match"] else "MISMATCH: " + "; ".join(d["mismatches"])
        lines.append(f"  outputs vs no-connector runs: {verdict} (max logprob diff {d['max_logprob_diff']:.2e})")
        k = d["kv_loaded_by_output"]
        lines.append(
            f"  outputs showing loaded KV (match only vLLM's own prefix hit): "
            f"{k['first']}/{k['of']} first sends, {k['repeat']}/{k['of']} repeats"
        )
    if "rates" in d:
        s = d["served_from_store"]
        lines.append(f"  served from store: {s['first']}/{s['of']} first sends, {s['repeat']}/{s['of']} repeats")
        lines += [f"  {rate}" for rate in d["rates"].values()]
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(d["tokens_hit_by_tier"].items()))
        lines.append(f"  hit tokens by tier: {tiers or 'none'}")
        if d["failures"]:
            lines.append(f"  failures: {d['failures']}")
    return "\n".join(lines)
