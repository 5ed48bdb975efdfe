"""``WorkerHalf`` end to end under stream semantics: the same stories for the CPU
(``EmulatedCudaDevice`` over CPU tensors, in tests/unit) and for a real GPU (``CudaDevice``
over CUDA tensors and the pinned shared host pool, in tests/gpu, marked ``gpu``).

The KV is paged in the flash-attention HND layout ``[2][blocks][heads][bs][d]`` per layer,
so the block dimension is not the first one.  A device is made by ``make(fail=f)``:
``fail(n)`` makes the n-th submitted job's copy fail on the stream.
"""

from __future__ import annotations

import time

import torch

from connector.scheduler import RequestView
from kvstore import codec, integrity
from tests.kits.halves import FLASH_HND, Engine, prompt, run_request

SHAPE = FLASH_HND
CHUNK_TOKENS = 64  # 4 blocks of 16 per chunk object
TOKENS = 300  # 4 full chunks + a 44-token tail (2 whole blocks)
SAVED = 5  # the 4 chunks and a tail object of 2 blocks
HIT = 288  # a repeat hits every whole block: 4 chunks + the tail
A_BLOCKS = list(range(0, 19))
B_BLOCKS = list(range(40, 59))
STEP_LIMIT = 50  # "a few steps": each engine step sleeps 10 ms


def engine(tmp_path, device, kv_device: str) -> Engine:
    return Engine(tmp_path, device, shape=SHAPE, kv_device=kv_device, chunk_size=CHUNK_TOKENS)


def saved_request(tmp_path, device, kv_device: str, worker_keys: bool = True) -> tuple[Engine, list[int]]:
    """Request "a" computed and finished; steps run (no drain, no preemption) until its
    saves are reported and its blocks released.  Returns the engine and the prompt.
    ``worker_keys=False``: a worker without the MAC keys (the scheduler seals at commit)."""
    e = engine(tmp_path, device, kv_device)
    if not worker_keys:
        e.worker.keys = None
    tokens = prompt(TOKENS, seed=1)
    assert run_request(e, "a", tokens, A_BLOCKS, seed=1) == 0
    assert e.sched.request_finished("a") is True  # saves planned: the free is delayed
    for steps in range(1, STEP_LIMIT + 1):
        e.step(finished={"a"})
        if "a" in e.sent and e.sched.stats.saves_committed == SAVED:
            break
        time.sleep(0.01)
    assert "a" in e.sent, f"blocks of a finished request not released after {steps} steps"
    assert e.sched.stats.saves_committed == SAVED
    return e, tokens


def story_saves_complete_and_release_blocks_without_preemption(tmp_path, device, kv_device):
    e, _ = saved_request(tmp_path, device, kv_device)
    assert not e.worker._save_events  # every gather observed
    e.close()


def story_every_sealed_object_verifies_and_holds_the_pages(tmp_path, device, kv_device):
    e, tokens = saved_request(tmp_path, device, kv_device)
    keys = e.sched._state(RequestView("probe", tokens)).keys[:4]
    pages_per_chunk = CHUNK_TOKENS // SHAPE.block_size
    for i, key in enumerate(keys):
        size = e.sched.store.host.size_of_sync(key)
        assert size is not None, f"chunk {i} not in host DRAM"
        buf = bytearray(size)
        assert e.sched.store.host.read_into_sync(key, buf) == size
        header = codec.verify(memoryview(buf), expected_key=key)  # checksum over landed bytes
        assert header.geometry.pages_per_layer == pages_per_chunk
        blocks = A_BLOCKS[i * pages_per_chunk : (i + 1) * pages_per_chunk]
        expected = _payload_of(e, blocks)
        assert bytes(buf[codec.HEADER_SIZE : codec.HEADER_SIZE + len(expected)]) == expected
    e.close()


def story_the_worker_seals_each_object_it_writes_whole_and_the_commit_leaves_the_mac(
    tmp_path, device, kv_device, worker_keys: bool = True
):
    """With MAC keys (an SSD directory), the worker seals each object on the thread that saw
    its gather land; the scheduler's commit only checks the key id and seals nothing itself
    (a worker without keys: the commit seals each one).  Every object verifies."""
    e, tokens = saved_request(tmp_path, device, kv_device, worker_keys)
    ring = e.sched.store.keys(None)
    assert ring is not None
    assert e.sched.store.counters.sealed == (0 if worker_keys else SAVED)  # sealed at commit
    for key in e.sched._state(RequestView("probe", tokens)).keys[:4]:
        buf = bytearray(e.sched.store.host.size_of_sync(key))
        e.sched.store.host.read_into_sync(key, buf)
        assert codec.decode_header(buf).key_id == ring.current
        assert integrity.check(memoryview(buf), ring) == ring.current
    e.close()


def story_loads_reach_consumable_and_pages_equal_the_originals(tmp_path, device, kv_device):
    e, tokens = saved_request(tmp_path, device, kv_device)
    e.reports.clear()
    assert run_request(e, "b", tokens, B_BLOCKS, seed=99) == HIT
    assert not e.errors
    n = HIT // SHAPE.block_size
    assert torch.equal(SHAPE.block(e.buf, B_BLOCKS[:n]), SHAPE.block(e.buf, A_BLOCKS[:n]))
    loads = [(ok, stages) for r in e.reports for ok in r.loads.values() for stages in [r.stages]]
    assert loads and all(ok for ok, _ in loads)
    reached = {name for _, stages in loads for name, _ in stages}
    assert {"IN_BUFFER", "ON_DEVICE", "CONSUMABLE", "RELEASED"} <= reached
    e.close()


def story_a_stream_copy_failure_becomes_failed_blocks(tmp_path, make_device, kv_device):
    target = [-1]
    device = make_device(fail=lambda n: n == target[0])
    e, tokens = saved_request(tmp_path, device, kv_device)
    target[0] = device._count + 2  # jobs: verify, layer 0, layer 1, ...
    assert run_request(e, "b", tokens, B_BLOCKS, seed=99) == HIT
    assert e.errors == set(B_BLOCKS[: HIT // 16])  # vLLM recomputes them
    assert device.failures == 1
    assert e.sched.stats.failures.get("load_copy_error") == 1
    e.errors.clear()
    assert run_request(e, "c", tokens, list(range(60, 79)), seed=7) == HIT  # next load is fine
    assert not e.errors
    n = HIT // 16
    assert torch.equal(SHAPE.block(e.buf, list(range(60, 60 + n))), SHAPE.block(e.buf, A_BLOCKS[:n]))
    e.close()


def _payload_of(e: Engine, blocks: list[int]) -> bytes:
    """The chunk payload the blocks should give: layer-major ``[layers][pages][page]``."""
    out = bytearray()
    for layer in range(SHAPE.layers):
        pages = torch.stack([e.buf[layer, :, b] for b in blocks]).contiguous().cpu()
        out += pages.view(torch.uint8).numpy().tobytes()
    return bytes(out)
