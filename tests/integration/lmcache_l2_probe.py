"""The probe of tests/integration/test_lmcache_l2.py: LMCache 0.5.6's own code driving our L2 adapter.

Runs under .venv's Python with ``.venv-lmcache`` (LMCache) and the checkout on PYTHONPATH, as a
child of the test, against the ``kvstore serve`` the test started.  Argument: a JSON object
(``target``, ``token_a``, ``token_b``: token files).  Each adapter is built by LMCache's own
``--l2-adapter`` parsing (``add_l2_adapters_args``, ``parse_args_to_l2_adapters_config``) and
factory (``create_l2_adapter_from_registry``, whose ``plugin`` type imports our module); each
operation is LMCache's submit / event fd / query cycle.  Phase ``main`` (round trip, tenants,
scopes, delete, usage, bad configs) prints ``RESTART`` and reads the restarted store's target
from stdin; phase ``restart`` reads the objects back.  The last stdout line is the JSON report.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
import traceback
from collections.abc import Callable

import lmcache
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.platform import consume_fd

SHAPE = torch.Size([2, 4, 16, 32])  # one LMCache KV object: 16 KiB of float32
MODEL = "tiny/model"
ALLOC = AdHocMemoryAllocator("cpu")


def adapter_spec(target: str, token_file: str, **more: object) -> str:
    params = {"store_target": target, "store_token_file": token_file, **more}
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "adapters.lmcache_l2.adapter",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": params,
        }
    )


def build(spec: str) -> L2AdapterInterface:
    """The adapter of one ``--l2-adapter`` JSON, by LMCache's parsing and factory."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", spec]))
    return create_l2_adapter_from_registry(config.adapters[0])


def wait(fd: int, timeout_s: float = 30.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout_s * 1000), f"event fd {fd} not signalled in {timeout_s} s"
    consume_fd(fd)


def until(query: Callable[[], object], fd: int) -> object:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = query()
        if result is not None:
            return result
        wait(fd)
    raise TimeoutError("task never completed")


def objects(seed: int, n: int) -> list:
    out = []
    for i in range(n):
        obj = ALLOC.allocate(SHAPE, torch.float32)
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed * 1000 + i)))
        out.append(obj)
    return out


def keys(n: int, model: str = MODEL, salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=bytes([i]) * 8, model_name=model, kv_rank=0, cache_salt=salt) for i in range(n)]


def store(adapter: L2AdapterInterface, ks: list[ObjectKey], objs: list) -> list:
    task = adapter.submit_store_task(ks, objs)
    done: dict = {}
    deadline = time.monotonic() + 30
    while task not in done and time.monotonic() < deadline:
        wait(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    result = done[task]
    return [result.is_successful(), result.bytes_transferred()]


def lookup(adapter: L2AdapterInterface, ks: list[ObjectKey]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(ks, {})
    bitmap = until(lambda: adapter.query_lookup_and_lock_result(task), adapter.get_lookup_and_lock_event_fd())
    adapter.submit_unlock(ks)
    return [int(bitmap.test(i)) for i in range(len(ks))]


def load(adapter: L2AdapterInterface, ks: list[ObjectKey]) -> tuple[list[int], list[bytes]]:
    bufs = [ALLOC.allocate(SHAPE, torch.float32) for _ in ks]
    for buf in bufs:
        buf.tensor.fill_(-1.0)
    task = adapter.submit_load_task(ks, bufs)
    bitmap = until(lambda: adapter.query_load_result(task), adapter.get_load_event_fd())
    return [int(bitmap.test(i)) for i in range(len(ks))], [bytes(buf.byte_array) for buf in bufs]


def digests(objs: list) -> list[bytes]:
    return [bytes(obj.byte_array) for obj in objs]


def _config_class() -> str:
    """The config class LMCache's plugin loader resolves for our adapter (its own lookup)."""
    import importlib

    from lmcache.v1.distributed.l2_adapters import plugin_l2_adapter as plugin

    module = importlib.import_module("adapters.lmcache_l2.adapter")
    config = plugin.PluginL2AdapterConfig("adapters.lmcache_l2.adapter", "KVStoreL2Adapter")
    found = plugin._resolve_config_class(module, config, module.KVStoreL2Adapter)
    return "" if found is None else found.__name__


def phase_main(args: dict, report: dict) -> None:
    a = build(adapter_spec(args["target"], args["token_a"]))
    b = build(adapter_spec(args["target"], args["token_b"]))
    report["loader"] = {
        "class": f"{type(a).__module__}.{type(a).__qualname__}",
        "is_l2_adapter": isinstance(a, L2AdapterInterface),
        "fds_distinct": len(
            {
                a.get_store_event_fd(),
                a.get_lookup_and_lock_event_fd(),
                a.get_load_event_fd(),
                b.get_store_event_fd(),
                b.get_lookup_and_lock_event_fd(),
                b.get_load_event_fd(),
            }
        ),
        "config_class": _config_class(),
        "lmcache": [lmcache.__version__, lmcache.__file__],
    }
    ks, mine, theirs = keys(6), objects(1, 6), objects(2, 6)
    report["store"] = store(a, ks, mine)
    report["usage_after_store"] = a.get_usage().total_bytes_used
    report["lookup"] = lookup(a, ks + keys(8)[6:])
    hits, got = load(a, ks)
    report["load"] = {"bits": hits, "equal": got == digests(mine)}
    report["tenant_b_before"] = lookup(b, ks)
    report["tenant_b_store"] = store(b, ks, theirs)
    hits_a, got_a = load(a, ks)
    hits_b, got_b = load(b, ks)
    report["tenants"] = {
        "a_equal": got_a == digests(mine),
        "b_equal": got_b == digests(theirs),
        "bits": hits_a + hits_b,
    }
    scoped = build(adapter_spec(args["target"], args["token_a"], scope="team-x"))
    report["apart"] = {
        "other_scope": lookup(scoped, ks),
        "other_model": lookup(a, keys(6, model="other/model")),
        "other_salt": lookup(a, keys(6, salt="user-7")),
    }
    scoped.close()
    a.delete(ks[:1])
    report["after_delete"] = {"lookup": lookup(a, ks), "usage": a.get_usage().total_bytes_used}
    report["status"] = a.report_status()
    for adapter in (a, b):
        adapter.close()
    report["bad_configs"] = bad_configs(args)


def bad_configs(args: dict) -> dict[str, str]:
    cases = {
        "no_tier": {"scope": "x"},
        "unknown_key": {"store_target": args["target"], "stor_token": "t"},
        "engine_key": {"store_target": args["target"], "chunk_size": 256},
        "host_pool": {"store_target": args["target"], "host_capacity": "1GiB"},
        "bad_scope": {"store_target": args["target"], "scope": 7},
        "bad_capacity": {"store_target": args["target"], "max_capacity_gb": -1},
        "bad_target": {"store_target": "no-port"},
    }
    out = {}
    for name, params in cases.items():
        spec = json.dumps(
            {
                "type": "plugin",
                "module_path": "adapters.lmcache_l2.adapter",
                "class_name": "KVStoreL2Adapter",
                "adapter_params": params,
            }
        )
        try:
            build(spec).close()
            out[name] = "accepted"
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            out[name] = f"{type(err).__name__}: {err}"
    return out


def phase_restart(args: dict, report: dict) -> None:
    a = build(adapter_spec(args["target"], args["token_a"]))
    b = build(adapter_spec(args["target"], args["token_b"]))
    ks = keys(6)
    report["lookup"] = lookup(a, ks)
    hits, got = load(a, ks[1:])
    report["load"] = {"bits": hits, "equal": got == digests(objects(1, 6))[1:]}
    hits, got = load(b, ks)
    report["load_b"] = {"bits": hits, "equal": got == digests(objects(2, 6))}
    report["status"] = a.report_status()
    a.close()
    b.close()


def run(phase: Callable[[dict, dict], None], args: dict) -> dict:
    report: dict = {}
    t0 = time.monotonic()
    try:
        phase(args, report)
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
        report["error"] = {"error": repr(err), "traceback": traceback.format_exc()}
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def main() -> None:
    args = json.loads(sys.argv[1])
    reports = {"main": run(phase_main, args)}
    print("RESTART", flush=True)
    args["target"] = json.loads(sys.stdin.readline())["target"]
    reports["restart"] = run(phase_restart, args)
    print(json.dumps(reports), flush=True)


if __name__ == "__main__":
    main()
