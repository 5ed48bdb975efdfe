"""``WorkerHalf`` end to end on a real GPU: ``CudaDevice`` (a side stream, CUDA events that
never call back), a paged KV in the HND layout on ``cuda:0`` and the shared host pool
pinned with ``cudaHostRegister``.  The same stories run on the CPU under ``emulated-cuda``
(tests/unit/test_worker_stream.py).  Run with ``scripts/gpu-check.sh``."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from connector.device import CudaDevice  # noqa: E402
from tests.kits import worker_stories as stories  # noqa: E402

pytestmark = pytest.mark.gpu


def make(fail=None):
    return CudaDevice(fail=fail)


def test_the_worker_pins_the_shared_pool(tmp_path):
    e = stories.engine(tmp_path, make(), "cuda")
    try:
        e.step()  # bind attaches the pool
        assert e.worker.mapped.pool.tensor is not None, "the worker's pool mapping is not page-locked"
        assert e.worker.mapped.pool_t.is_pinned()
    finally:
        e.close()


def test_saves_complete_and_release_blocks_without_preemption(tmp_path):
    stories.story_saves_complete_and_release_blocks_without_preemption(tmp_path, make(), "cuda")


def test_every_sealed_object_verifies_and_holds_the_pages(tmp_path):
    stories.story_every_sealed_object_verifies_and_holds_the_pages(tmp_path, make(), "cuda")


def test_the_worker_seals_each_object_it_writes_whole_and_the_commit_leaves_the_mac(tmp_path):
    stories.story_the_worker_seals_each_object_it_writes_whole_and_the_commit_leaves_the_mac(tmp_path, make(), "cuda")


def test_loads_reach_consumable_and_pages_equal_the_originals(tmp_path):
    stories.story_loads_reach_consumable_and_pages_equal_the_originals(tmp_path, make(), "cuda")


def test_a_stream_copy_failure_becomes_failed_blocks(tmp_path):
    stories.story_a_stream_copy_failure_becomes_failed_blocks(tmp_path, make, "cuda")
