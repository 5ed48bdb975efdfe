"""The CUDA copy engine and paged gather/scatter on a real GPU (docs/architecture.md#copy-engines).  Needs CUDA.

The story: a copy issued on the side stream is invisible to the compute stream until
``make_compute_wait`` orders them, after which compute sees the copied bytes; a job that
fails after enqueuing copies reports its error only once those copies are done; and
``PagedKV`` moves pages between KV blocks on ``cuda:0`` and a pinned host pool exactly.
Run with ``scripts/gpu-check.sh`` or ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from connector.device import CudaDevice, make_device  # noqa: E402
from connector.transfer import PagedKV  # noqa: E402
from kvstore.codec import HEADER_SIZE  # noqa: E402

pytestmark = pytest.mark.gpu

SLOW = 200_000_000  # GPU cycles of torch.cuda._sleep: long enough (~0.1 s) to expose a race
N = 1 << 22  # floats per test buffer (16 MiB)
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 32, 16, 4, 64
NAMES = [f"layer.{i}" for i in range(LAYERS)]


@pytest.fixture
def device():
    dev = CudaDevice()
    yield dev
    dev.close()


def test_make_device_picks_cuda():
    dev = make_device("auto")
    assert isinstance(dev, CudaDevice) and dev.name == "cuda"
    dev.close()


def test_compute_sees_a_side_stream_copy_only_after_make_compute_wait(device):
    src = torch.arange(N, dtype=torch.float32, device="cuda")
    host = torch.zeros(N, dtype=torch.float32, pin_memory=True)

    def d2h():
        torch.cuda._sleep(SLOW)  # the copy is still running when submit returns
        host.copy_(src, non_blocking=True)

    event = device.submit(d2h)
    assert event.error is None
    assert device.make_compute_wait(event)
    back = host.to("cuda", non_blocking=True)  # compute stream reads the pinned buffer
    assert torch.equal(back, src)
    assert event.wait() and event.ok and event.query()


def test_synchronize_completes_every_event(device):
    src = torch.ones(N, device="cuda")
    host = torch.zeros(N, pin_memory=True)
    events = [
        device.submit(lambda: (torch.cuda._sleep(SLOW // 4), host.copy_(src, non_blocking=True))) for _ in range(3)
    ]
    assert not any(e._done.is_set() for e in events)  # still running on the side stream
    assert device.synchronize()
    assert all(e._done.is_set() and e.ok for e in events)
    assert bool((host == 1).all())


def test_a_failing_job_completes_only_after_the_copies_it_enqueued(device):
    src = torch.arange(N, dtype=torch.float32, device="cuda")
    host = torch.zeros(N, dtype=torch.float32, pin_memory=True)

    def half_done():
        torch.cuda._sleep(SLOW)
        host.copy_(src, non_blocking=True)
        raise OSError("second layer failed")

    event = device.submit(half_done)
    assert isinstance(event.error, OSError) and not event.ok
    # The ticket may free `host` now: the copy into it must already be over.
    assert torch.equal(host, src.cpu())
    assert device.make_compute_wait(event)


def gpu_kv(fill: bool):
    """Flash-attention style per-layer ``[2, blocks, block_size, heads, head_dim]`` on cuda:0."""
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = (
        torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        if fill
        else torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    )
    return {name: buf[i] for i, name in enumerate(NAMES)}


def test_paged_gather_and_scatter_between_cuda_blocks_and_a_pinned_pool(device):
    src_ids, dst_ids = [5, 2, 9, 30], [0, 31, 7, 8]
    kv, empty = gpu_kv(True), gpu_kv(False)
    paged, dst = PagedKV(kv, NAMES, BLOCKS), PagedKV(empty, NAMES, BLOCKS)
    pool = torch.zeros(
        HEADER_SIZE + LAYERS * len(src_ids) * paged.layout.page_bytes, dtype=torch.uint8, pin_memory=True
    )
    payload = paged.payload_view(pool, 0, len(src_ids))

    saved = device.submit(lambda: paged.gather(src_ids, payload))
    assert saved.wait() and saved.ok
    expected = torch.stack([kv[n][:, src_ids].movedim(1, 0) for n in NAMES]).cpu()
    assert torch.equal(payload.view(torch.int16), expected.view(torch.int16))

    loaded = device.submit(lambda: [dst.scatter_layer(i, dst_ids, payload) for i in range(LAYERS)])
    assert device.make_compute_wait(loaded)
    others = [b for b in range(BLOCKS) if b not in dst_ids]
    for n in NAMES:
        assert torch.equal(empty[n][:, dst_ids].view(torch.int16), kv[n][:, src_ids].view(torch.int16))
        assert not empty[n][:, others].view(torch.int16).any()


def _median_seconds(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_copy_bandwidth_is_reported(device, capsys):
    nbytes = 32 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    limit = _median_seconds(lambda: dev.copy_(host, non_blocking=True))
    via_device = _median_seconds(lambda: device.submit(lambda: dev.copy_(host, non_blocking=True)).wait())
    d2h = _median_seconds(lambda: host.copy_(dev, non_blocking=True))
    with capsys.disabled():
        print(
            f"\nH2D 32 MiB: plain copy_ {nbytes / limit / 1e9:.1f} GB/s, "
            f"CudaDevice {nbytes / via_device / 1e9:.1f} GB/s ({limit / via_device:.0%}); "
            f"D2H {nbytes / d2h / 1e9:.1f} GB/s"
        )
