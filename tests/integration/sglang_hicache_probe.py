"""The kvstore HiCache backend driven by SGLang 0.5.23's own classes, under SGLang's Python.

Run by ``tests/integration/test_sglang_hicache.py`` under ``.venv-sglang`` (``make sglang``):
``python sglang_hicache_probe.py ARGS_JSON`` runs the parts of phase ``main``, prints
``RESTART`` and waits for a line ``{"target": HOST:PORT}`` on stdin (the test has restarted
the store meanwhile), runs phase ``restart``, then prints one JSON report of both on its last
stdout line; the tests (under ``.venv``) assert on it.  ARGS_JSON names the store process
(``target``), the tenants' token files (``token_a``, ``token_b``), a keys file and a work
directory.  One process: SGLang is imported once.

Phase ``main``:
  env        which sglang and torch were imported;
  interface  ``HiCacheStorage``'s abstract methods and the class on our MRO defining each,
             and which of the v1/v2 methods our class defines itself;
  factory    SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)`` with our
             module and class named in the extra config; a bad extra config's error;
  cli        the documented flags through SGLang's argument parser, ``ServerArgs`` and its
             parser of the extra config (inline and ``@file``), then its factory;
  keys       SGLang's page keys (``get_storage_hash_str``) for a token sequence: their form,
             the chain (a change in page 0 changes every later key), our object names;
  layouts    for each host layout of SGLang's ``MHATokenToKVPoolHost`` (over its
             ``MHATokenToKVPool`` on the CPU): pages set and read back through the v1 API
             (``batch_set``/``batch_get`` with its data pages) and ``batch_set_v1``/
             ``batch_get_v1`` (host indices), bytes compared; another layout's keys miss;
  controller SGLang's ``HiCacheController`` methods (``_page_backup``, ``_storage_hit_query``,
             ``_page_transfer``), run unbound on an object holding the attributes they read,
             over a sequence with a missing page: the hit and the transfer stop at it;
  pools      KV, Mamba (``MambaPoolHost``) and sliding-window pools through the v2 API,
             with the same calls made on SGLang's ``HiCacheFile``: both answers recorded;
  tenants    two tenants' backends (the store's tokens) and two scopes, same keys;
  persist    pages written through the store process and through an SSD-only backend,
             then closed (phase ``restart`` reads them back).
Phase ``restart`` (after the test restarted the store): the same pages read back through
new backends (over the new store process, and over the reopened SSD directory).
"""

from __future__ import annotations

import functools
import json
import queue
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

PAGE = 4  # tokens per page
LAYERS, HEADS, DIM = 3, 2, 8
MODEL = "probe/tiny-model"
TOKENS = list(range(1000, 1000 + 6 * PAGE))  # six pages


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
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


def backend(extra: dict):
    from adapters.sglang_hicache.backend import KVStoreHiCache

    return KVStoreHiCache(storage_config({"host_capacity": "16MiB", **extra}), {})


def remote(args: dict, tenant: str = "a", scope: str = "") -> dict:
    """The extra config of a backend over the store process, as tenant ``tenant``."""
    return {"store_target": args["target"], "store_token_file": args[f"token_{tenant}"], "scope": scope}


def host_pool(layout: str, seed: int = 0):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(
        16 * PAGE, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        write_back_staging=device.hicache_write_back_staging,
    )
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(host.kv_buffer.dtype))
    return host


def page_keys(tokens=TOKENS) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(tokens, None, page_size=PAGE))


def pages_equal(pool, a: torch.Tensor, b: torch.Tensor) -> list[bool]:
    def page(idx: torch.Tensor, i: int) -> torch.Tensor:
        return pool.get_data_page(int(idx[i * PAGE]), flat=True)

    return [torch.equal(page(a, i), page(b, i)) for i in range(len(a) // PAGE)]


# --- parts ------------------------------------------------------------------------------------------


def env_part() -> dict:
    import sglang

    return {"sglang": sglang.__version__, "sglang_file": sglang.__file__, "torch": torch.__version__}


def interface_part() -> dict:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from adapters.sglang_hicache.backend import KVStoreHiCache

    def owner(name: str) -> str:
        cls = next(c for c in KVStoreHiCache.__mro__ if name in c.__dict__)
        return f"{cls.__module__}.{cls.__qualname__}"

    api = [
        "get",
        "batch_get",
        "set",
        "batch_set",
        "exists",
        "batch_exists",
        "batch_get_v1",
        "batch_set_v1",
        "batch_exists_v2",
        "batch_get_v2",
        "batch_set_v2",
        "register_mem_pool_host",
        "register_mem_host_pool_v2",
    ]
    return {
        "subclass": issubclass(KVStoreHiCache, HiCacheStorage),
        "abstract": {name: owner(name) for name in sorted(HiCacheStorage.__abstractmethods__)},
        "still_abstract": sorted(KVStoreHiCache.__abstractmethods__),
        "defines": {name: owner(name) for name in api},
    }


def factory_part(args: dict) -> dict:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = {
        "backend_name": "kvstore",
        "module_path": "adapters.sglang_hicache.backend",
        "class_name": "KVStoreHiCache",
        "host_capacity": "16MiB",
        **remote(args),
    }
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host_pool("layer_first"))
    out = {"class": f"{type(made).__module__}.{type(made).__qualname__}", "tiers": [t.name for t in made.store.tiers]}
    made.close()
    for name, bad in {
        "engine_key": {**extra, "chunk_size": 256},
        "no_lower_tier": {k: v for k, v in extra.items() if k not in ("store_target", "store_token_file")},
    }.items():
        try:
            StorageBackendFactory.create_backend("dynamic", storage_config(bad), None).close()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded: the error a user sees
            out[name] = _error(exc)
    return out


def cli_part(args: dict) -> dict:
    """The command line of docs/sglang-hicache.md through SGLang's own parsing: its CLI
    arguments, ``ServerArgs``, its parser of the extra config (inline JSON and ``@file``),
    then its backend factory."""
    import argparse

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.server_args import ServerArgs

    extra = {
        "backend_name": "kvstore",
        "module_path": "adapters.sglang_hicache.backend",
        "class_name": "KVStoreHiCache",
        "host_capacity": "16MiB",
        "hicache_storage_pass_prefix_keys": True,
        **remote(args),
    }
    path = Path(args["work"]) / "hicache.json"
    path.write_text(json.dumps(extra))
    out = {}
    for form, value in (("inline", json.dumps(extra)), ("file", f"@{path}")):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        server = ServerArgs.from_cli_args(
            parser.parse_args(
                [
                    "--model-path",
                    MODEL,
                    "--enable-hierarchical-cache",
                    "--hicache-storage-backend",
                    "dynamic",
                    "--hicache-storage-backend-extra-config",
                    value,
                ]
            )
        )
        parsed, *_ = HybridCacheController.parse_storage_backend_extra_config(
            server.hicache_storage_backend_extra_config
        )
        made = StorageBackendFactory.create_backend(server.hicache_storage_backend, storage_config(parsed), None)
        out[form] = {
            "backend": server.hicache_storage_backend,
            "hierarchical": server.enable_hierarchical_cache,
            "class": f"{type(made).__module__}.{type(made).__qualname__}",
            "tiers": [t.name for t in made.store.tiers],
        }
        made.close()
    return out


def keys_part() -> dict:
    from adapters.sglang_hicache.names import page_hash

    keys = page_keys()
    changed = page_keys([TOKENS[0] + 1, *TOKENS[1:]])
    tail_changed = page_keys([*TOKENS[:-1], TOKENS[-1] + 1])
    return {
        "keys": keys,
        "tokens": TOKENS,
        "page": PAGE,
        "hex64": all(len(k) == 64 and int(k, 16) >= 0 for k in keys),
        "first_page_changed": [a != b for a, b in zip(keys, changed)],
        "last_page_changed": [a != b for a, b in zip(keys, tail_changed)],
        "object_names_are_keys": all(page_hash(k).hex() == k for k in keys),
        "repeat_equal": page_keys() == keys,
    }


def layouts_part(args: dict) -> dict:
    out = {}
    extra = remote(args, scope="layouts")
    keys = page_keys()
    written = None
    for n, layout in enumerate(("layer_first", "page_first", "page_first_direct", "page_head")):
        pool, be = host_pool(layout, seed=n), backend(extra)
        be.register_mem_pool_host(pool)
        src, dst, dst2 = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
        row = {
            "other_layout_hits": be.batch_exists(written) if written else None,
            "exists_before": be.batch_exists(keys[:3]),
        }
        pages = [pool.get_data_page(int(src[i * PAGE]), flat=True) for i in range(3)]
        row["batch_set"] = be.batch_set(keys[:3], pages)
        got = be.batch_get(keys[:3], [pool.get_dummy_flat_data_page() for _ in range(3)])
        for i, page in enumerate(got):
            pool.set_from_flat_data_page(int(dst[i * PAGE]), page)
        row["batch_get_equal"] = pages_equal(pool, src, dst)
        row["set_v1"] = be.batch_set_v1(keys[3:6], src)
        row["get_v1"] = be.batch_get_v1(keys[3:6], dst2)
        row["get_v1_equal"] = pages_equal(pool, src, dst2)
        row["exists_after"] = be.batch_exists(keys)
        row["not_all_zero"] = bool(pool.get_data_page(int(dst2[0]), flat=True).abs().sum() > 0)
        out[layout] = row
        written = keys
        be.close()
    return out


def controller_part(args: dict) -> dict:
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation

    pool = host_pool("layer_first", seed=7)
    be = backend(remote(args, scope="controller"))
    be.register_mem_pool_host(pool)
    keys = page_keys()
    ctl = SimpleNamespace(
        storage_backend=be,
        page_size=PAGE,
        storage_host_pool=pool,
        mem_pool_host=pool,
        prefetch_sync_queue=queue.Queue(),
    )
    ctl.page_set_func = functools.partial(HiCacheController._generic_page_set, ctl)
    ctl._page_transfer_kv_batch = functools.partial(HiCacheController._page_transfer_kv_batch, ctl)
    src = pool.alloc(6 * PAGE)
    # pages 0-3 backed up, page 4 never, page 5 alone: a hole at 4
    HiCacheController._page_backup(ctl, StorageOperation(src[: 4 * PAGE], TOKENS[: 4 * PAGE], hash_value=keys[:4]))
    HiCacheController._page_backup(
        ctl, StorageOperation(src[5 * PAGE :], TOKENS[5 * PAGE :], hash_value=keys[5:], prefix_keys=keys[:5])
    )
    out = {"exists_each": [be.exists(k) for k in keys]}
    hashes, hit_tokens = HiCacheController._storage_hit_query(ctl, PrefetchOperation("r1", TOKENS))
    out["hit_query"] = {"tokens": hit_tokens, "keys_equal": hashes == keys[: len(hashes)]}
    for name, fn in (("generic", HiCacheController._generic_page_get), ("v1", HiCacheController._page_get_zero_copy)):
        ctl.page_get_func = functools.partial(fn, ctl)
        op = PrefetchOperation(f"r-{name}", TOKENS)
        op.hash_value, op.host_indices = keys, pool.alloc(6 * PAGE)
        pages = HiCacheController._page_transfer(ctl, op)
        out[name] = {"pages": pages, "equal": pages_equal(pool, src[: 4 * PAGE], op.host_indices[: 4 * PAGE])}
    acks = []
    while not ctl.prefetch_sync_queue.empty():
        acks.append(ctl.prefetch_sync_queue.get().completed_tokens)
    out["acks"] = acks
    be.close()
    return out


def mamba_pool():
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    gen = torch.Generator().manual_seed(3)
    info = MambaStateBufferInfo(
        temporal=torch.randn(2, 8, 4, 4, generator=gen),
        conv=(torch.randn(2, 8, 3, 5, generator=gen).to(torch.bfloat16),),
    )
    host = MambaPoolHost(info, 2, 0, device_capacity=8, pin_memory=False, layout="page_first")
    for t in (host.temporal_buffer, *host.conv_buffer):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return host


def pools_part(args: dict) -> dict:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer

    kv, swa, mamba = host_pool("page_first", 11), host_pool("page_first", 12), mamba_pool()
    ours = backend(remote(args, scope="pools"))
    peer = HiCacheFile(storage_config({"file_storage_path": str(Path(args["work"]) / "hicache-file")}))
    keys = page_keys()
    kv_idx, swa_idx, m_idx = kv.alloc(6 * PAGE), swa.alloc(6 * PAGE), mamba.alloc(6)
    out: dict = {"ours": {}, "file": {}}
    for label, be in (("ours", ours), ("file", peer)):
        be.register_mem_pool_host(kv)
        be.register_mem_host_pool_v2(kv, PoolName.KV)
        be.register_mem_host_pool_v2(swa, PoolName.SWA)
        be.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        rec = out[label]
        rec["set"] = be.batch_set_v2(
            [
                PoolTransfer(PoolName.KV, host_indices=kv_idx, keys=keys),
                PoolTransfer(PoolName.SWA, host_indices=swa_idx[4 * PAGE :], keys=keys[4:]),
                PoolTransfer(PoolName.MAMBA, host_indices=m_idx[2:3], keys=keys[2:3]),
            ]
        )
        rec["set_mamba_5"] = be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=m_idx[5:6], keys=keys[5:6])])
        trailing = [
            PoolTransfer(PoolName.MAMBA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(PoolName.SWA, keys=keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ]
        for case, transfers in {
            "kv_only": [],
            "mamba_trailing": trailing[:1],
            "swa_trailing": trailing[1:],
            "both_trailing": trailing,
            "swa_all_pages": [PoolTransfer(PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)],
        }.items():
            r = be.batch_exists_v2(keys, transfers)
            rec[case] = {
                "kv_hit_pages": r.kv_hit_pages,
                "extra": {str(k): v for k, v in sorted(r.extra_pool_hit_pages.items(), key=str)},
                "restorable": r.restorable_prefix_pages,
            }
        dst_m, dst_swa = mamba.alloc(2), swa.alloc(2 * PAGE)
        got = be.batch_get_v2(
            [
                PoolTransfer(PoolName.MAMBA, host_indices=dst_m, keys=[keys[2], keys[5]]),
                PoolTransfer(PoolName.SWA, host_indices=dst_swa, keys=keys[4:]),
            ]
        )
        rec["get"] = {str(k): v for k, v in got.items()}
        rec["mamba_equal"] = [
            torch.equal(mamba.get_data_page(int(a)), mamba.get_data_page(int(b)))
            for a, b in zip([m_idx[2], m_idx[5]], dst_m)
        ]
        rec["swa_equal"] = pages_equal(swa, swa_idx[4 * PAGE :], dst_swa)
        rec["missing_mamba"] = be.batch_get_v2(
            [PoolTransfer(PoolName.MAMBA, host_indices=mamba.alloc(1), keys=keys[3:4])]
        )["mamba"]
    try:
        ours.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=kv_idx[:PAGE], keys=keys[:1])])
        out["unknown_pool"] = None
    except ValueError as exc:
        out["unknown_pool"] = _error(exc)
    ours.close()
    return out


def tenants_part(args: dict) -> dict:
    pool = host_pool("layer_first", seed=21)
    mk = {"a": remote(args), "b": remote(args, "b"), "a_other_scope": remote(args, scope="other")}
    bes = {name: backend(extra) for name, extra in mk.items()}
    for be in bes.values():
        be.register_mem_pool_host(pool)
    keys = page_keys()[:2]
    a_idx, b_idx = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    out = {"a_set": bes["a"].batch_set_v1(keys, a_idx)}
    out["b_exists"] = bes["b"].batch_exists(keys)
    out["other_scope_exists"] = bes["a_other_scope"].batch_exists(keys)
    out["b_get"] = [p is not None for p in bes["b"].batch_get(keys)]
    out["b_get_one"], out["a_get_one"] = bes["b"].get(keys[0]), bes["a"].get(keys[0])
    out["a_get_one"] = out["a_get_one"] is not None and torch.equal(
        out["a_get_one"], pool.get_data_page(int(a_idx[0]), flat=True)
    )
    other = pool.get_data_page(int(b_idx[0]), flat=True)
    out["other_scope_set_one"] = bes["a_other_scope"].set(keys[0], other)
    got = bes["a_other_scope"].get(keys[0], pool.get_dummy_flat_data_page())
    out["other_scope_get_one"] = got is not None and torch.equal(got, other)
    out["b_set"] = bes["b"].batch_set_v1(keys, b_idx)
    dst_a, dst_b = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    out["a_get"], out["b_get_own"] = bes["a"].batch_get_v1(keys, dst_a), bes["b"].batch_get_v1(keys, dst_b)
    out["a_reads_a"], out["b_reads_b"] = pages_equal(pool, a_idx, dst_a), pages_equal(pool, b_idx, dst_b)
    out["a_differs_b"] = not any(pages_equal(pool, a_idx, b_idx))
    for be in bes.values():
        be.close()
    return out


def persist_extras(args: dict) -> dict:
    return {
        "store": remote(args, scope="persist"),
        "ssd": {
            "ssd_dir": str(Path(args["work"]) / "own-ssd"),
            "ssd_capacity": "64MiB",
            "host_capacity": "16MiB",
            "keys_file": args["keys_file"],
            "scope": "persist",
        },
    }


def persist_part(args: dict, read: bool) -> dict:
    out = {"keys": page_keys()}
    for name, extra in persist_extras(args).items():
        pool, be = host_pool("page_first", seed=31), backend(extra)  # same seed: the same bytes in both phases
        be.register_mem_pool_host(pool)
        src = pool.alloc(3 * PAGE)
        if read:
            dst = pool.alloc(3 * PAGE)
            out[name] = {
                "exists": be.batch_exists(out["keys"]),
                "get": be.batch_get_v1(out["keys"][:3], dst),
                "equal": pages_equal(pool, src, dst),
            }
        else:
            out[name] = {"set": be.batch_set_v1(out["keys"][:3], src)}
        be.close()
    return out


def run_parts(parts: dict) -> dict:
    report: dict = {"seconds": {}}
    for name, part in parts.items():
        t0 = time.perf_counter()
        try:
            report[name] = part()
        except BaseException as exc:  # noqa: BLE001 - recorded per part, so the others still run
            report[name] = {"error": _error(exc), "traceback": traceback.format_exc()[-3000:]}
        report["seconds"][name] = round(time.perf_counter() - t0, 2)
    return report


def main() -> None:
    args = json.loads(sys.argv[1])
    report = {
        "main": run_parts(
            {
                "env": env_part,
                "interface": interface_part,
                "factory": lambda: factory_part(args),
                "cli": lambda: cli_part(args),
                "keys": keys_part,
                "layouts": lambda: layouts_part(args),
                "controller": lambda: controller_part(args),
                "pools": lambda: pools_part(args),
                "tenants": lambda: tenants_part(args),
                "persist": lambda: persist_part(args, False),
            }
        )
    }
    print("RESTART", flush=True)  # the test restarts the store and answers its new address
    args["target"] = json.loads(sys.stdin.readline())["target"]
    report["restart"] = run_parts({"persist": lambda: persist_part(args, True)})
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
