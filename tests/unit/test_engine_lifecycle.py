"""The engine's lifecycle, driven through a real connector pair in vLLM's recorded hook order
(``tests/kits/halves.py``: a real host pool, SSD directory and worker, no vLLM engine).

* Resets (``reset_cache``): nothing stored before is loaded again into this engine, from any
  tier; lower tiers keep it for engines on the old weights; requests running across a reset
  save nothing more; final saves not yet gathered are cancelled and their blocks freed; our
  host tier's removals are published with their medium.
* Weights versions (``kv_transfer_params``, ``connector.epoch``): engines declaring the same
  version after a reset share through SSD; another version, or none, never does.
* Sleep and wake in vLLM 0.33's order (scheduler ``reset_cache``, worker
  ``unregister_kv_caches``, wake, ``restore_kv_caches``): gathers in flight finish first, no
  copy touches the KV tensor while asleep, and loads work again after wake.
* vLLM's own statistics: per-source hit tokens and our counters on its Prometheus metrics.

Cost: about 5 s (no engine).
"""

from __future__ import annotations

import functools

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.emulated_cuda import EmulatedCudaDevice
from connector.epoch import ParamsError, WeightsEpoch, parse_params
from connector.kvcache_events import ConnectorEvents, RemovedEvent
from connector.plan import ChunkCopy, LoadJob, SaveJob
from connector.scheduler import RequestView, StepInput
from connector.vllm_stats import KVStorePromMetrics, hit_source
from tests.kits.halves import Engine, fill, finish, prompt

BS = 128
V1 = {"kvstore": {"weights_version": "step-1"}}
V2 = {"kvstore": {"weights_version": "step-2"}}


def store(engine: Engine, req_id: str, tokens, blocks, params=None, seed: int = 0) -> int:
    """One whole request: lookup, prefill, finish, and its saves settled.  Returns hit tokens."""
    n = lookup(engine, req_id, tokens, params)
    engine.sched.after_alloc(req_id, blocks, n)
    computed = list(range(n // BS, (len(tokens) + BS - 1) // BS))
    engine.step(
        new=[(req_id, blocks, n)],
        scheduled={req_id: len(tokens) - n},
        compute=lambda: fill(engine, [blocks[i] for i in computed], seed) if computed else None,
    )
    finish(engine, req_id)
    engine.settle()
    engine.sched.drain()
    return n


def lookup(engine: Engine, req_id: str, tokens, params=None) -> int:
    view = RequestView(req_id, tokens, params=params)
    n = engine.sched.matched_tokens(view, 0)
    while n is None:
        n = engine.sched.matched_tokens(view, 0)
    return n


def published(engine: Engine) -> int:
    return engine.sched.store.host.stats().objects


@pytest.fixture
def engines(tmp_path):
    made = []

    def make(**cfg):
        """A new engine on the same SSD directory (the one before it stops first: an SSD
        directory has one owner at a time)."""
        if made:
            made.pop().close()
        made.append(Engine(tmp_path, **cfg))
        return made[-1]

    yield make
    for e in made:
        e.close()


# --- resets --------------------------------------------------------------------------------


def test_after_a_reset_nothing_stored_before_is_loaded_again_from_any_tier(engines):
    a = engines()
    p = prompt(700, seed=1)
    assert store(a, "r1", p, list(range(1, 7))) == 0
    assert lookup(a, "r2", p) == 640  # every whole block but the last: host DRAM
    a.sched.request_finished("r2")
    assert published(a) > 0
    done = a.sched.reset()
    assert done["dropped"] > 0 and published(a) == 0
    assert lookup(a, "r3", p) == 0  # not from host DRAM, not from SSD
    assert a.sched.stats.resets == {"total": 1, "host_objects_dropped": done["dropped"], "saves_cancelled": 0}
    a.sched.request_finished("r3")
    # The lower tier was not wiped: an engine still on the loaded files' weights hits it there.
    b = engines()
    assert lookup(b, "b1", p) == 640
    assert b.sched.stats.tokens_hit_by_tier == {"ssd": 640}


def test_a_request_running_across_a_reset_saves_nothing_more(engines):
    a = engines()
    p = prompt(3 * 256 + 10, seed=2)
    blocks = list(range(1, 8))
    assert lookup(a, "run", p) == 0
    a.sched.after_alloc("run", blocks, 0)
    # Chunk 0 computed before the reset: saved under the old weights' keys.
    a.step(new=[("run", blocks, 0)], scheduled={"run": 256}, compute=lambda: fill(a, blocks[:2], 0))
    a.settle()
    saved_before = a.sched.saves.committed
    assert saved_before == 1
    a.sched.reset()
    # Chunks 1 and 2 are computed after it (new weights): they must not be saved under the old keys.
    plan = a.step(cached=[("run", None, 256, False)], scheduled={"run": 512}, compute=lambda: fill(a, blocks[2:6], 0))
    assert plan.saves == []
    assert a.sched.request_finished("run", len(p)) is False or a.sched.jobs.final == []
    a.settle()
    assert a.sched.saves.committed == saved_before and published(a) == 0


def test_a_final_save_pending_at_a_reset_is_cancelled_and_its_blocks_are_freed(engines):
    a = engines()
    p = prompt(300, seed=3)
    tokens = p + prompt(100, seed=30)  # the prompt, then its answer
    blocks = [1, 2, 3, 4]
    assert a.sched.matched_tokens(RequestView("f", p, tokens=tokens), 0) == 0
    a.sched.after_alloc("f", blocks, 0)
    a.step(new=[("f", blocks, 0)], scheduled={"f": 300}, compute=lambda: fill(a, blocks, 0))
    a.settle()
    committed = a.sched.saves.committed
    assert a.sched.request_finished("f", 399) is True  # the answer's whole block waits for the next step
    assert len(a.sched.jobs.final) == 1
    done = a.sched.reset()
    assert done["cancelled"] == 1 and a.sched.jobs.final == []
    a.buf.fill_(float("nan"))  # a sleep discarded the pages it would read
    plan = a.step(finished={"f"})
    assert plan.saves == [] and plan.released == ["f"]
    assert "f" in a.sent  # vLLM may free its blocks
    a.settle()
    assert a.sched.saves.committed == committed and published(a) == 0
    assert a.sched.store.host.stats().extra["pending"] == 0  # the reservation was given back


def test_a_reset_publishes_the_removal_of_our_host_blocks_with_their_medium(engines):
    a = engines(kv_events=lambda store: ConnectorEvents(store, 256, BS, publish=True))
    events = a.sched.kv_events
    p = prompt(600, seed=4)
    store(a, "e", p, list(range(1, 6)))
    events.take()
    held = published(a)
    a.sched.reset()
    removed = [e for e in events.take() if isinstance(e, RemovedEvent)]
    assert len(removed) == held > 0
    assert {(e.medium, e.reason) for e in removed} == {("CPU", "reset")}


# --- weights versions ----------------------------------------------------------------------


def test_engines_declaring_the_same_version_after_a_reset_share_and_others_never_do(engines):
    p = prompt(700, seed=5)
    a = engines()
    a.sched.reset()
    assert store(a, "a1", p, list(range(1, 7)), V1) == 0
    assert lookup(a, "a2", p, V1) == 640 and a.sched.epoch.current == "memory:step-1"
    a.sched.request_finished("a2")
    b = engines()  # same weights pushed, same version declared
    b.sched.reset()
    assert lookup(b, "b1", p, V1) == 640
    assert b.sched.stats.tokens_hit_by_tier == {"ssd": 640}
    c = engines()  # other weights
    c.sched.reset()
    assert lookup(c, "c1", p, V2) == 0
    d = engines()  # weights updated, nobody said which
    d.sched.reset()
    assert lookup(d, "d1", p) == 0 and d.sched.epoch.current.startswith("memory:unlabelled:")
    e = engines()  # never reset: the files' weights, even labelled step-1
    assert lookup(e, "e1", p, V1) == 0 and e.sched.epoch.current == "files:step-1"


def test_a_request_declaring_another_version_is_recomputed_counted_and_told(engines):
    a = engines()
    a.sched.reset()
    p = prompt(400, seed=6)
    store(a, "ok", p, [1, 2, 3, 4], V1)
    assert lookup(a, "bad", p, V2) == 0
    assert a.sched.stats.not_cached == {"weights_version_mismatch": 1}
    a.sched.request_finished("bad")
    error = a.sched.output_params("bad")["kvstore"]["error"]
    assert "'step-1'" in error and "'step-2'" in error
    assert a.sched.output_params("bad") is None  # told once
    assert lookup(a, "again", p, V1) == 384  # the declared version still hits
    a.sched.request_finished("again")
    a.sched.reset()  # a new epoch takes a new declaration
    assert lookup(a, "next", p, V2) == 0 and a.sched.epoch.current == "memory:step-2"


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"kvstore": {"weights_version": 5}}, "weights_version"),
        ({"kvstore": {"weights_version": ""}}, "weights_version"),
        ({"kvstore": {"weights_version": "a b"}}, "weights_version"),
        ({"kvstore": {"weights_version": "x" * 129}}, "weights_version"),
        ({"kvstore": "step-1"}, "must be an object"),
        ({"kvstore": {"pin": True}}, "needs a session"),
        ({"kvstore": {"session": 7}}, "session"),
        ({"kvstore": {"session": "s", "continues": "no"}}, "continues must be true or false"),
        ({"kvstore": {"session": "s", "pin": 1}}, "pin must be true or false"),
        ({"kvstore": {"session": "s", "resume_in_s": -1}}, "resume_in_s"),
        ({"kvstore": {"session": "s", "resume_in_s": float("nan")}}, "resume_in_s"),
        ({"kvstore": {"session": "s", "resume_in_s": True}}, "resume_in_s"),
        ("step-1", "must be an object"),
    ],
)
def test_malformed_params_refuse_the_connector_for_that_request_only(engines, params, fragment):
    a = engines()
    p = prompt(400, seed=7)
    store(a, "first", p, [1, 2, 3, 4])
    with pytest.raises(ParamsError, match=fragment):
        parse_params(params)
    assert lookup(a, "bad", p, params) == 0
    assert a.sched.stats.not_cached == {"bad_kv_transfer_params": 1}
    a.sched.request_finished("bad")
    assert fragment in a.sched.output_params("bad")["kvstore"]["error"]
    assert lookup(a, "good", p) == 384  # the engine goes on serving


def test_unknown_keys_are_ignored_and_counted_and_other_connectors_keys_left_alone(engines):
    a = engines()
    p = prompt(400, seed=8)
    store(a, "first", p, [1, 2, 3, 4])
    params = {"kvstore": {"priority": "high", "ttl_s": 60}, "do_remote_prefill": True}
    assert lookup(a, "x", p, params) == 384
    assert a.sched.stats.params_unknown_keys == {"priority,ttl_s": 1}
    assert lookup(a, "y", p, {"do_remote_prefill": True}) == 384
    assert a.sched.stats.params_unknown_keys == {"priority,ttl_s": 1}
    assert parse_params(None) == parse_params({}) == parse_params({"other": 1})


def test_the_first_version_declared_in_an_epoch_names_it_until_the_next_reset():
    w = WeightsEpoch()
    assert w.current == "" and w.admit(None)
    assert w.admit("v0") and w.current == "files:v0"
    assert not w.admit("v1") and w.current == "files:v0"
    w.reset()
    unlabelled = w.current
    assert unlabelled.startswith("memory:unlabelled:") and w.admit(None) and w.current == unlabelled
    w.reset()
    assert w.current != unlabelled  # each reset: a namespace nobody had
    assert w.admit("v1") and w.current == "memory:v1" and w.admit("v1") and not w.admit("v0")


# --- sleep and wake ------------------------------------------------------------------------


def test_sleep_drains_gathers_in_flight_refuses_copies_while_asleep_and_wakes_on_the_tensors(engines):
    """vLLM 0.33's order: the scheduler's ``reset_cache`` (pause with clear_cache), the
    worker's ``unregister_kv_caches``, the memory freed (here: the tensor poisoned), wake,
    ``restore_kv_caches``.  The emulated CUDA device makes gathers land late."""
    a = engines(device=EmulatedCudaDevice(delay=0.2))
    p = prompt(600, seed=9)
    blocks = list(range(1, 6))
    assert lookup(a, "s", p) == 0
    a.sched.after_alloc("s", blocks, 0)
    a.step(new=[("s", blocks, 0)], scheduled={"s": 600}, compute=lambda: fill(a, blocks, 0))
    assert a.worker._save_events  # gathers still in flight
    a.sched.reset()  # sleep(level=1): pause_scheduler(clear_cache)
    assert a.worker.unregister() == len(a.worker._save_events) or a.worker._save_events == []
    assert a.worker.asleep and a.worker.kv is None
    assert a.worker.take_interval()["sleep_drained"] >= 1
    a.settle()  # the drained gathers' report
    a.buf.fill_(float("nan"))  # the sleep allocator discarded the KV
    poisoned = a.buf.clone()
    # A plan arriving while asleep: its copies are refused, the tensor untouched.
    plan = a.sched.build_plan(StepInput())
    plan.loads = [LoadJob(999, "ghost", [ChunkCopy(0, bytes(64) + b"r0", [1, 2])])]
    plan.saves = [SaveJob(998, "ghost", [ChunkCopy(0, bytes(64) + b"r0", [3, 4])], 256)]
    a.worker.bind(plan)
    a.worker.start_loads()
    a.worker.finish_loads()
    a.worker.submit_saves()
    assert a.buf.isnan().all() and torch.equal(a.buf.isnan(), poisoned.isnan())  # no copy touched it
    assert a.worker.load_errors() == {1, 2}  # vLLM recomputes those blocks
    report = a.worker.take_report()
    assert report.loads == {999: False} and report.saves == {998: [False]}
    assert report.failures == {"cancelled_asleep": 2}
    assert a.worker.finished_sending({"ghost"}) == {"ghost"}
    # Wake: the worker copies into the same tensor again.
    a.worker.restore()
    assert not a.worker.asleep and a.worker.kv is not None
    a.buf.zero_()
    q = prompt(600, seed=10)
    assert store(a, "after", q, [6, 7, 8, 9, 10]) == 0
    assert lookup(a, "after2", q) == 512
    a.sched.after_alloc("after2", [11, 12, 13, 14, 15], 512)
    a.step(new=[("after2", [11, 12, 13, 14, 15], 512)], scheduled={"after2": 600 - 512})
    assert not a.buf[:, 11:15].isnan().any() and a.buf[:, 11:15].abs().sum() > 0
    assert torch.equal(a.buf[:, 11:15], a.buf[:, 6:10])  # loaded what was saved after wake
    assert a.worker.unregister() == 0 and a.worker.unregister() == 0  # idempotent
    a.worker.restore()
    a.worker.restore()
    assert not a.worker.asleep


# --- vLLM's own statistics -----------------------------------------------------------------


def test_hit_sources_split_each_requests_hit_by_tier_in_vllms_terms(engines):
    p = prompt(700, seed=11)
    a = engines()
    store(a, "a", p, list(range(1, 7)))
    q = p[:256] + prompt(444, seed=12)  # shares chunk 0 only
    store(a, "q", q, list(range(1, 7)))
    b = engines()
    assert lookup(b, "ssd-hit", p) == 640
    assert b.sched.hit_sources("ssd-hit", 640) == {"ssd": 640}
    b.sched.request_finished("ssd-hit")
    assert lookup(b, "mixed", q) == 640  # chunk 0 promoted to host DRAM, the rest on SSD
    assert b.sched.hit_sources("mixed", 640) == {"host": 256, "ssd": 384}
    assert b.sched.hit_sources("mixed", 320) == {"host": 128, "ssd": 192}  # what the engine took
    assert b.sched.hit_sources("unknown", 128) == {}
    assert hit_source("host", "host") is CacheHitSource.HOST
    assert hit_source("ssd", "host") is CacheHitSource.DISK
    assert hit_source("remote", "host") is hit_source("redis", "host") is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_our_counters_reach_vllms_prometheus_metrics_with_its_engine_labels(engines):
    a = engines()
    p = prompt(700, seed=12)
    store(a, "m1", p, list(range(1, 7)))
    assert lookup(a, "m2", p) == 640
    first = a.sched.interval_counters()
    assert first["requests"] == 2 and first["tokens_hit_by_tier:host"] == 640
    assert first["decisions:load"] == 1 and first["decisions:miss"] == 1
    assert a.sched.interval_counters() == {}  # deltas: nothing new since
    a.sched.reset()
    second = a.sched.interval_counters()
    assert second["resets:total"] == 1 and second["resets:host_objects_dropped"] > 0

    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    metrics = KVStorePromMetrics(_Cfg(), types, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})
    metrics.observe({**first, "bytes_by_tier:ssd:read": 4096, "loads": 3, "unknown_key": 7}, engine_idx=1)
    metrics.observe(second, engine_idx=0)
    value = registry.get_sample_value
    assert value("vllm:kvstore_hit_tokens_by_tier_total", {"model_name": "tiny", "engine": "1", "tier": "host"}) == 640
    assert value("vllm:kvstore_load_decisions_total", {"model_name": "tiny", "engine": "1", "outcome": "load"}) == 1
    assert (
        value(
            "vllm:kvstore_tier_bytes_total", {"model_name": "tiny", "engine": "1", "tier": "ssd", "direction": "read"}
        )
        == 4096
    )
    assert value("vllm:kvstore_worker_loads_total", {"model_name": "tiny", "engine": "1"}) == 3
    assert value("vllm:kvstore_cache_resets_total", {"model_name": "tiny", "engine": "0", "what": "total"}) == 1


class _Cfg:
    kv_transfer_config = None
