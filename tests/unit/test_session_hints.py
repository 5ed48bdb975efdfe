"""Session hints of ``kv_transfer_params`` (``connector.sessions``), driven through a real
connector pair in vLLM's hook order (``tests/kits/halves.py``: a real host pool, SSD
directory and worker, no vLLM engine):

* ``continues: false`` releases the session's objects that no other session holds: they
  leave host DRAM before older ones; a shared first chunk keeps its place.
* ``pin: true`` keeps a session's objects in host DRAM while other requests' saves push the
  rest out; ``pin: false`` gives them back to the policy.
* ``resume_in_s`` brings a session's objects evicted from host DRAM back from SSD before it
  resumes, and the next turn then hits host DRAM with the same pages.

Cost: about 10 s (no engine).
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.scheduler import RequestView
from tests.kits.halves import Engine, fill, finish, prompt

BS = 128
CHUNK = 256  # two blocks per object


def session(name: str, **hint) -> dict:
    return {"kvstore": {"session": name, **hint}}


def lookup(engine: Engine, req_id: str, tokens, params=None) -> int:
    view = RequestView(req_id, tokens, params=params)
    n = engine.sched.matched_tokens(view, 0)
    while n is None:
        n = engine.sched.matched_tokens(view, 0)
    return n


def run(engine: Engine, req_id: str, tokens, params=None, seed: int = 0) -> int:
    """One whole request on blocks 0..: lookup, prefill, finish, saves settled; hit tokens."""
    blocks = list(range(-(-len(tokens) // BS)))
    n = lookup(engine, req_id, tokens, params)
    engine.sched.after_alloc(req_id, blocks, n)
    computed = list(range(n // BS, len(blocks)))
    engine.step(
        new=[(req_id, blocks, n)],
        scheduled={req_id: len(tokens) - n},
        compute=lambda: fill(engine, [blocks[i] for i in computed], seed) if computed else None,
    )
    finish(engine, req_id)
    engine.settle()
    engine.sched.drain()
    return n


def keys_of(engine: Engine, tokens) -> list:
    """The chunk keys of ``tokens`` (a probe state the scheduler forgets again)."""
    req_id = f"probe-{len(engine.sched._reqs)}-{hash(tuple(tokens))}"
    keys = list(engine.sched._state(RequestView(req_id, tokens)).keys)
    engine.sched._reqs.pop(req_id, None)
    return keys


def in_host(engine: Engine, keys) -> list[bool]:
    return [engine.sched.store.host.contains_sync(k) for k in keys]


@pytest.fixture
def engines(tmp_path):
    made: list[Engine] = []

    def make(**cfg) -> Engine:
        # 8 objects fit: two 16 KiB pages per layer and a header, 68 KiB slots
        made.append(Engine(tmp_path / str(len(made)), host_capacity="560KiB", chunk_size=CHUNK, **cfg))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def engine(engines):
    return engines()


def test_an_ended_session_leaves_host_dram_first_but_its_shared_prefix_stays(engine):
    system = prompt(CHUNK, seed=1)
    a = system + prompt(2 * CHUNK, seed=2)
    b = system + prompt(2 * CHUNK, seed=3)
    run(engine, "a1", a, session("a"))
    run(engine, "b1", b, session("b"))  # b's own objects are newer than a's
    shared, *a_own = keys_of(engine, a)
    assert in_host(engine, [shared, *a_own]) == [True] * 3
    run(engine, "a2", a, session("a", continues=False))  # a hits everything, then ends
    assert engine.sched.sessions.counts["released"] == 2  # its two own chunks, not the shared one
    assert engine.sched.store.host.stats().objects == 5
    run(engine, "x0", prompt(2 * CHUNK, seed=10))
    run(engine, "x1", prompt(2 * CHUNK, seed=11))
    run(engine, "x2", prompt(CHUNK, seed=12))  # 10 objects for 8 slots: two go, a's own
    assert in_host(engine, a_own) == [False, False]
    assert in_host(engine, keys_of(engine, b)) == [True] * 3  # b and the shared prefix stay


def test_a_pinned_session_stays_in_host_dram_until_it_unpins(engines):
    engine = engines(host_retention="lru")  # without the pin, a would go first
    a = prompt(3 * CHUNK, seed=4)
    run(engine, "a1", a, session("a", pin=True))
    for i in range(4):  # 8 objects of others through an 8-object pool
        run(engine, f"x{i}", prompt(2 * CHUNK, seed=20 + i))
    assert in_host(engine, keys_of(engine, a)) == [True] * 3
    assert run(engine, "a2", a, session("a", pin=False)) == 3 * CHUNK - BS  # all but the last block
    for i in range(4):
        run(engine, f"y{i}", prompt(2 * CHUNK, seed=30 + i))
    assert in_host(engine, keys_of(engine, a)) == [False] * 3  # the policy's order again
    assert not engine.sched.store.host._pools[""].hints.pinned


def test_a_resume_brings_the_sessions_objects_back_from_ssd_before_its_next_turn(engine):
    a = prompt(3 * CHUNK, seed=5)
    keys = keys_of(engine, a)
    run(engine, "a1", a, session("a", resume_in_s=3.0), seed=5)  # prefetch 2.25 s later
    pages = [engine.buf[:, b].clone() for b in range(6)]
    for k in keys:  # evicted meanwhile (written through to SSD first)
        assert engine.sched.store.host.delete_sync(k)
    assert in_host(engine, keys) == [False] * 3
    deadline = time.monotonic() + 30
    while not all(in_host(engine, keys)):
        assert time.monotonic() < deadline, "the resume prefetch never brought the objects back"
        time.sleep(0.05)
    assert engine.sched.sessions.counts["promoted"] == 3
    engine.buf.zero_()
    assert run(engine, "a2", a, session("a")) == 3 * CHUNK - BS
    assert engine.sched.stats.tokens_hit_by_tier == {"host": 3 * CHUNK - BS}
    assert all(torch.equal(engine.buf[:, b], pages[b]) for b in range(5))  # the loaded pages
