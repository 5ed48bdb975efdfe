"""``WorkerHalf`` end to end under CUDA's stream semantics on the CPU (``emulated-cuda``),
on a flash-attention HND paged KV: the stories of ``tests/kits/worker_stories.py``, which
tests/gpu/test_worker_cuda.py runs on a real GPU."""

from __future__ import annotations

import pytest

from connector.emulated_cuda import EmulatedCudaDevice
from tests.kits import worker_stories as stories


def make(fail=None):
    return EmulatedCudaDevice(delay=0.002, fail=fail)


def test_saves_complete_and_release_blocks_without_preemption(tmp_path):
    stories.story_saves_complete_and_release_blocks_without_preemption(tmp_path, make(), "cpu")


def test_every_sealed_object_verifies_and_holds_the_pages(tmp_path):
    stories.story_every_sealed_object_verifies_and_holds_the_pages(tmp_path, make(), "cpu")


@pytest.mark.parametrize("worker_keys", [True, False], ids=["worker-seals", "commit-seals"])
def test_the_worker_seals_each_object_it_writes_whole_and_the_commit_leaves_the_mac(tmp_path, worker_keys):
    stories.story_the_worker_seals_each_object_it_writes_whole_and_the_commit_leaves_the_mac(
        tmp_path, make(), "cpu", worker_keys
    )


def test_loads_reach_consumable_and_pages_equal_the_originals(tmp_path):
    stories.story_loads_reach_consumable_and_pages_equal_the_originals(tmp_path, make(), "cpu")


def test_a_stream_copy_failure_becomes_failed_blocks(tmp_path):
    stories.story_a_stream_copy_failure_becomes_failed_blocks(tmp_path, make, "cpu")
