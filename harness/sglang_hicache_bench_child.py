"""The measured part of ``kvstore bench sglang-hicache``: runs under SGLang's Python (``.venv-sglang``).

Started by ``harness.bench_sglang_hicache`` (host side) as ``python sglang_hicache_bench_child.py
ARGS_JSON``; prints one JSON report on its last stdout line.  ARGS_JSON holds the workload
(``pages``, ``page_size``, ``layers``, ``heads``, ``head_dim``, ``dtype``, ``layout``,
``repeats``), a work directory and the setups: per name, ``kind`` (``kvstore`` or
``hicache-file``), ``extra`` (SGLang's extra config for the backend) and ``path`` (``v1``:
SGLang's zero-copy page functions, ``batch_set_v1``/``batch_get_v1``; ``generic``: its
``batch_set``/``batch_get`` of flat pages, the only path ``HiCacheFile`` has).

One SGLang host pool (``MHATokenToKVPoolHost`` over its ``MHATokenToKVPool`` on the CPU), filled
with random bytes; page keys from SGLang's ``get_storage_hash_str`` (new tokens each repeat).
Per repeat and setup, all through SGLang's own ``HiCacheController`` methods run unbound (as
SGLang's storage threads run them): ``_page_backup`` of every page, then ``close()`` (our
backend writes down what it staged), the host pool cleared, a fresh backend (the restart),
``_storage_hit_query`` and ``_page_transfer`` back into the same host indices, every page
compared with what was set; the setups' order rotates each repeat.  The limit, measured right
before each setup in each repeat: each page's bytes written to a file of its own (no fsync),
each file looked up (``exists``), and read back (``readinto``); an untimed ``os.sync()`` first.
With ``page_cache`` "cold" (the default), every file a setup or the limit wrote is fsynced and
dropped from the page cache before it is read back (untimed), so every read comes from the
device: our SSD tier keeps its writes out of the page cache (host DRAM is a tier of its own),
``HiCacheFile`` and the limit do not, and only cold reads compare them on equal footing.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

MODEL = "bench/sglang-hicache"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def storage_config(extra: dict) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=MODEL,
        extra_config=dict(extra),
    )


def make_backend(setup: dict, where: Path) -> Any:
    """A new backend of ``setup`` over ``where`` (its directory for this repeat)."""
    if setup["kind"] == "hicache-file":
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        return HiCacheFile(storage_config({**setup["extra"], "file_storage_path": str(where)}))
    from adapters.sglang_hicache.backend import KVStoreHiCache

    extra = dict(setup["extra"])
    if "ssd_dir" in extra:
        extra["ssd_dir"] = str(where)
    return KVStoreHiCache(storage_config(extra), {})


def host_pool(a: dict) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers, page = a["layers"], a["page_size"]
    device = MHATokenToKVPool(
        a["pages"] * page, page, DTYPES[a["dtype"]], a["heads"], a["head_dim"], layers, "cpu", False,
        start_layer=0, end_layer=layers - 1,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        1,
        0,
        page,
        a["layout"],
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        write_back_staging=device.hicache_write_back_staging,
    )
    gen = torch.Generator().manual_seed(1)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.kv_buffer.dtype))
    return host


def controller(be: Any, pool: Any, path: str) -> SimpleNamespace:
    """The attributes SGLang's controller methods read, with the page functions SGLang picks."""
    from sglang.srt.managers.cache_controller import HiCacheController as C

    ctl = SimpleNamespace(
        storage_backend=be,
        page_size=pool.page_size,
        storage_host_pool=pool,
        mem_pool_host=pool,
        prefetch_sync_queue=queue.Queue(),
    )
    get, put = (
        (C._page_get_zero_copy, C._page_set_zero_copy) if path == "v1" else (C._generic_page_get, C._generic_page_set)
    )
    ctl.page_get_func, ctl.page_set_func = functools.partial(get, ctl), functools.partial(put, ctl)
    ctl._page_transfer_kv_batch = functools.partial(C._page_transfer_kv_batch, ctl)
    return ctl


def pages_of(pool: Any, idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[i * pool.page_size]), flat=True).clone() for i in range(n)]


def close(be: Any) -> None:
    if hasattr(be, "close"):
        be.close()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def drop_cache(where: Path, cold: bool) -> None:
    """Every file under ``where`` synced and dropped from the page cache (when ``cold``)."""
    from tiers.ssd_files import drop_page_cache  # the project is on this child's PYTHONPATH

    for path in sorted(p for p in where.rglob("*") if p.is_file()) if cold and where.exists() else ():
        drop_page_cache(path)


def run_setup(setup: dict, where: Path, pool: Any, idx: torch.Tensor, tokens: list[int], ref: list, cold: bool) -> dict:
    """One repeat of one setup: set (through close), restart, hit query, get, compare."""
    from sglang.srt.managers.cache_controller import HiCacheController as C
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    keys = list(get_storage_hash_str(tokens, None, page_size=pool.page_size))
    be = make_backend(setup, where)
    be.register_mem_pool_host(pool)
    op = StorageOperation(idx, tokens, hash_value=keys)
    t0 = time.perf_counter()
    C._page_backup(controller(be, pool, setup["path"]), op)
    acked = time.perf_counter() - t0
    close(be)
    set_s = time.perf_counter() - t0
    pool.kv_buffer.zero_()  # the host pool forgets every page: what comes back, came from storage
    drop_cache(where, cold)
    be2, open_s = timed(lambda: make_backend(setup, where))
    be2.register_mem_pool_host(pool)
    ctl = controller(be2, pool, setup["path"])
    (hashes, hit_tokens), hit_s = timed(lambda: C._storage_hit_query(ctl, PrefetchOperation("bench", tokens)))
    fetch = PrefetchOperation("bench-get", tokens)
    fetch.hash_value, fetch.host_indices = hashes, idx
    got, get_s = timed(lambda: C._page_transfer(ctl, fetch))
    close(be2)
    equal = sum(torch.equal(a, b) for a, b in zip(pages_of(pool, idx, len(ref)), ref))
    return {
        "path": setup["path"],
        "set_pages": op.completed_tokens // pool.page_size,
        "hit_pages": hit_tokens // pool.page_size,
        "got_pages": got,
        "equal_pages": int(equal),
        "seconds": {"set_acked": acked, "set": set_s, "open": open_s, "hit": hit_s, "get": get_s},
    }


def run_limit(where: Path, ref: list[torch.Tensor], cold: bool) -> dict:
    """The same bytes, one plain file per page: written (no fsync), each looked up (``exists``),
    then read back with ``readinto``."""
    where.mkdir(parents=True)
    views = [p.contiguous().view(torch.uint8).numpy() for p in ref]
    t0 = time.perf_counter()
    for i, view in enumerate(views):
        with open(where / f"{i}.bin", "wb") as f:
            f.write(view)
    set_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    present = sum((where / f"{i}.bin").exists() for i in range(len(views)))
    hit_s = time.perf_counter() - t0
    target = torch.zeros(len(views), views[0].size, dtype=torch.uint8).numpy()  # touched: no page faults timed
    drop_cache(where, cold)
    t0 = time.perf_counter()
    for i in range(len(views)):
        with open(where / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(target[i])
    get_s = time.perf_counter() - t0
    equal = sum(bool((target[i] == v).all()) for i, v in enumerate(views))
    return {"equal_pages": equal, "hit_pages": present, "seconds": {"set": set_s, "hit": hit_s, "get": get_s}}


def main() -> None:
    a = json.loads(sys.argv[1])
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # it would override our directories
    import sglang

    work, pool = Path(a["work"]), host_pool(a)
    cold = a.get("page_cache", "cold") == "cold"
    idx = pool.alloc(a["pages"] * a["page_size"])
    ref = pages_of(pool, idx, a["pages"])
    original = pool.kv_buffer.clone()
    report: dict = {
        "sglang": sglang.__version__,
        "page_bytes": ref[0].numel() * ref[0].element_size(),
        "setups": {name: [] for name in a["setups"]},
    }
    for rep in range(a["repeats"]):
        tokens = list(range(rep * len(ref) * a["page_size"], (rep + 1) * len(ref) * a["page_size"]))
        names = list(a["setups"])
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # the first place rotates
            where, plain = work / f"{name}-{rep}", work / f"limit-{name}-{rep}"
            os.sync()  # untimed: no dirty pages of the last setup left to throttle this one's writes
            limit = run_limit(plain, ref, cold)  # right before the setup: the same load on the machine
            shutil.rmtree(plain)
            try:
                result = run_setup(a["setups"][name], where, pool, idx, tokens, ref, cold)
            except Exception as exc:  # noqa: BLE001 - reported per setup; the host side fails the run
                result = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
            report["setups"][name].append({**result, "limit": limit})
            pool.kv_buffer.copy_(original)
            shutil.rmtree(where, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
