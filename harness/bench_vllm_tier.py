"""``kvstore bench vllm-tier`` (or ``python -m harness.bench_vllm_tier``): our vLLM secondary
tier (``adapters.vllm_tier``) beside vLLM's own file-system tier (``fs``), in one run, on the
same blocks, through the same vLLM code: ``TieringOffloadingSpec`` builds a
``TieringOffloadingManager`` over a real CPU primary region (/dev/shm), the tier under it.
Setups: ``kvstore`` (our tier on an SSD directory), ``kvstore-serve`` (our tier over a
``kvstore serve`` started here, host pool only: the restart is vLLM's, the store keeps
running, so its loads come from the store's memory) and ``vllm-fs`` (on a directory).

Host side: the bench plays vLLM's scheduler and, where vLLM's worker would copy between GPU
and primary rows (CUDA/XPU only), writes and reads the rows itself.

Per setup and repeat, on a fresh directory: ``--blocks`` blocks of random bytes (one block a
chunk; K and V of ``--layers`` x ``--kv-heads`` x ``--head-dim`` x ``--block-tokens`` in
float16: a TinyLlama-1.1B-like 352 KiB by default) go into the primary tier as requests of
``--request-blocks``, and ``complete_store`` cascades them to the tier (store: first
``complete_store`` to no pending work).  A restart (a fresh manager, primary empty) asks for
every key each step (every 1 ms), as vLLM's scheduler does, until all are primary hits:
lookup ends when no key is ``RETRY`` any more, load when all are loaded.  The loaded rows
are compared with the stored bytes; a difference or a missing block makes the exit status 1.

The limit, in the same run and filesystem: plain files of the same blocks (one a block, as
both tiers lay them out) from and into one mmap'd region, on 16 threads (vLLM's fs tier's
count): ``os.pwrite`` into the page cache, no fsync (store); ``os.stat`` (lookup);
``os.preadv`` (load).  No checksum, rename or durability: the bound of buffered I/O, which
vLLM's ``O_DIRECT`` reads (no page-cache copy) may pass.

Page cache: vLLM's fs tier uses ``O_DIRECT`` where the filesystem takes it (the run prints
whether); kvstore's SSD tier writes through the page cache, fsyncs each object and its
directory before a store counts, and drops the pages.  ``--page-cache cold`` (default)
fsyncs and drops (``POSIX_FADV_DONTNEED``) every file of every setup and of the limit before
the restart, so all loads read the device; ``warm`` leaves them.  The stores are not on equal
footing, by design: kvstore's is durable (fsync), vLLM's ``O_DIRECT`` write is not fsynced.
``--damage-one`` flips a byte of one stored file per file-backed setup before the restart, to show the
comparison fail (exit status 1).

Speed is measured here, never asserted in tests; the machine may be shared, so compare the
figures of one run only.  The order of the setups rotates every repeat; figures are medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.common import Row, gbps, print_rows
from kvstore.testing.serve_proc import StoreProcess
from tiers.ssd_files import drop_page_cache

SETUPS = ("kvstore", "kvstore-serve", "vllm-fs")
LIMIT = "plain files"
STEP_S = 0.001  # the scheduler's step period while it waits for the tier
TIMEOUT_S = 120.0
PAGE = 4096
LIMIT_THREADS = 16  # as many as vLLM's fs tier has for its stores (and its loads)


def _tier(setup: str, root: Path, store: str) -> dict[str, Any]:
    """vLLM's ``secondary_tiers`` entry of ``setup`` over the directory ``root`` (``kvstore-serve``:
    over the store process at ``store``, in a scope of the pass's own)."""
    ours = {"type": "KVStoreSecondaryTier", "module_path": "adapters.vllm_tier"}
    if setup == "kvstore":
        return {**ours, "ssd_dir": str(root)}
    if setup == "kvstore-serve":
        return {**ours, "store_target": store, "scope": root.name}
    return {"type": "fs", "root_dir": str(root)}


@dataclass(frozen=True)
class Layout:
    """One block's geometry: K and V of every layer for ``block_tokens`` tokens."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    block_bytes: int  # 0: computed from the above (float16)

    @property
    def size(self) -> int:
        return self.block_bytes or 2 * self.layers * self.kv_heads * self.head_dim * 2 * self.block_tokens


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.bench_vllm_tier", description=__doc__.split("\n")[0])
    _add_arguments(p)
    return p.parse_args(argv)


def register(suites) -> None:
    """``kvstore bench vllm-tier`` (a ``kvstore.bench`` entry point)."""
    p = suites.add_parser("vllm-tier", help="our vLLM secondary tier beside vLLM's own fs tier, through vLLM's manager")
    _add_arguments(p)
    p.set_defaults(func=command)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=128, help="blocks stored and loaded back (default 128)")
    p.add_argument("--request-blocks", type=int, default=16, help="blocks per request (one store job each)")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--block-bytes", type=int, default=0, help="bytes per block (default: from the layout, float16)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-cache", choices=("cold", "warm"), default="cold", help="drop written files before loads")
    p.add_argument("--dir", type=Path, default=None, help="where the directories go (default: a temporary one)")
    p.add_argument("--damage-one", action="store_true", help="flip a byte of one stored file per file-backed setup")
    p.add_argument("--json", default=None, help="write the rows and the checks here")


# --- vLLM's manager, as its OffloadingConnectorScheduler drives it ------------------------------


def _manager(model: Path, layout: Layout, blocks: int, tier: dict[str, Any]) -> Any:
    """vLLM's ``TieringOffloadingManager``: a primary tier of ``blocks`` chunks, ``tier`` under it."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.layers))
    par = dict(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=layout.block_tokens, layer_names=names, group_id=0),),
        worker_kv_bytes_per_block=layout.size,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": layout.size * blocks, "secondary_tiers": [tier]},
        engine_id=f"kvstore-bench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=str(model), dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=layout.block_tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            **par, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True
        ),
    )
    return TieringOffloadingSpec(config).get_manager()


def _rows(mgr: Any) -> np.ndarray:
    return np.asarray(mgr.primary_tier.get_kv_memoryview())


def _settle(mgr: Any) -> None:
    """Scheduler steps until no transfer is in flight."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    deadline = time.monotonic() + TIMEOUT_S
    while mgr.has_pending_work():
        if time.monotonic() > deadline:
            raise TimeoutError("the tiering manager still has pending work")
        mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(STEP_S)


def _store(mgr: Any, requests: list[list[bytes]], data: list[bytes]) -> float:
    """The rows written (the worker's copies, untimed), then vLLM's cascade: seconds to done."""
    from vllm.v1.kv_offload.base import ReqContext

    ctxs, rows, blocks = [ReqContext(req_id=f"save{i}") for i in range(len(requests))], _rows(mgr), iter(data)
    for ctx, keys in zip(ctxs, requests, strict=True):
        mgr.on_new_request(ctx)
        out = mgr.prepare_store(keys, ctx)
        if out is None or list(out.keys_to_store) != keys:
            raise RuntimeError(f"vLLM's primary tier did not take request {ctx.req_id}'s blocks: {out}")
        for chunk in out.store_spec.chunk_ids:
            rows[chunk] = np.frombuffer(next(blocks), np.uint8)
    t0 = time.perf_counter()
    for ctx, keys in zip(ctxs, requests, strict=True):
        mgr.complete_store(keys, ctx)
        mgr.on_request_finished(ctx)
    _settle(mgr)
    return time.perf_counter() - t0


def _lookup_load(mgr: Any, requests: list[list[bytes]]) -> tuple[float, float, list[bytes | None]]:
    """Every key asked for, each step, as vLLM's scheduler asks, until all are hits in the
    primary tier: (lookup seconds, load seconds, the loaded rows; None where one missed)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    ctxs = [ReqContext(req_id=f"load{i}") for i in range(len(requests))]
    for ctx in ctxs:
        mgr.on_new_request(ctx)
    t0, found, deadline = time.perf_counter(), None, time.monotonic() + TIMEOUT_S
    while True:
        answers = [mgr.lookup(k, ctx) for ctx, keys in zip(ctxs, requests, strict=True) for k in keys]
        if found is None and LookupResult.RETRY not in answers:
            found = time.perf_counter() - t0
        if all(a is LookupResult.HIT for a in answers):
            break
        if LookupResult.MISS in answers and LookupResult.RETRY not in answers and not mgr.has_pending_work():
            break  # a key missed and every load has ended: what landed is all there is
        if time.monotonic() > deadline:
            raise TimeoutError(f"keys still not loaded after {TIMEOUT_S} s: {answers}")
        mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(STEP_S)
    loaded_s, rows, out = time.perf_counter() - t0, _rows(mgr), []
    for ctx, keys in zip(ctxs, requests, strict=True):
        hits = [mgr.lookup(k, ctx) is LookupResult.HIT for k in keys]
        present = [k for k, hit in zip(keys, hits, strict=True) if hit]
        chunks = iter(mgr.prepare_load(present, ctx).chunk_ids if present else ())
        out += [rows[next(chunks)].tobytes() if hit else None for hit in hits]
        if present:
            mgr.complete_load(present, ctx)
        mgr.on_request_finished(ctx)
    return (found if found is not None else loaded_s), loaded_s, out


# --- one pass of a setup, and of the limit ----------------------------------------------------


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _drop_cache(root: Path) -> None:
    """Every file under ``root`` synced and dropped from the page cache."""
    for path in _files(root):
        drop_page_cache(path)


def _damage(root: Path, block: int) -> None:
    """One byte flipped near the end of the first file that holds a whole block (its payload)."""
    path = next(p for p in _files(root) if p.stat().st_size >= block)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))


@dataclass
class Pass:
    """One repeat of one setup: seconds per phase, blocks equal, blocks missing."""

    store_s: float
    lookup_s: float
    load_s: float
    equal: int
    missing: int
    o_direct: bool | None = None


def _setup_pass(setup: str, root: Path, model: Path, args: argparse.Namespace, work: Workload) -> Pass:
    blocks, tier = len(work.data), _tier(setup, root, args.store_target)
    mgr = _manager(model, args.layout, blocks, tier)
    try:
        o_direct = getattr(mgr.secondary_tiers[0], "_use_o_direct", None)
        store_s = _store(mgr, work.requests, work.data)
    finally:
        mgr.shutdown()
    if args.page_cache == "cold":
        _drop_cache(root)
    if args.damage_one and setup != "kvstore-serve":  # its objects are in the store's memory
        _damage(root, args.layout.size)
    mgr = _manager(model, args.layout, blocks, tier)  # the restart: primary empty
    try:
        lookup_s, load_s, loaded = _lookup_load(mgr, work.requests)
    finally:
        mgr.shutdown()
    equal = sum(a == b for a, b in zip(loaded, work.data, strict=True))
    return Pass(store_s, lookup_s, load_s, equal, loaded.count(None), o_direct)


def _write(path: Path, block: memoryview) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, block, 0)
    finally:
        os.close(fd)


def _read(path: Path, block: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [block], 0)
    finally:
        os.close(fd)


def _limit_pass(root: Path, args: argparse.Namespace, work: Workload) -> Pass:
    """Plain files of the same blocks, from and into one mmap'd region, on ``LIMIT_THREADS``
    threads (module docstring)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    size, region = args.layout.size, mmap.mmap(-1, args.layout.size * len(work.data))
    view, paths = memoryview(region), [root / f"{i}.bin" for i in range(len(work.data))]
    rows = [view[i * size : (i + 1) * size] for i in range(len(paths))]
    for row, block in zip(rows, work.data, strict=True):
        row[:] = block
    with ThreadPoolExecutor(LIMIT_THREADS) as pool:
        t0 = time.perf_counter()
        list(pool.map(_write, paths, rows))
        store_s = time.perf_counter() - t0
        if args.page_cache == "cold":
            _drop_cache(root)
        region.seek(0)
        region.write(bytes(len(region)))
        t0 = time.perf_counter()
        found = sum(path.stat().st_size == size for path in paths)
        lookup_s = time.perf_counter() - t0
        got = list(pool.map(_read, paths, rows))
        load_s = time.perf_counter() - t0
    equal = sum(n == size and row == block for n, row, block in zip(got, rows, work.data, strict=True))
    for row in rows:
        row.release()
    view.release()
    region.close()
    return Pass(store_s, lookup_s, load_s, equal, len(paths) - found)


@dataclass(frozen=True)
class Workload:
    """The keys (vLLM's offload keys, one list per request) and each block's bytes."""

    requests: list[list[bytes]]
    data: list[bytes]


def workload(blocks: int, request_blocks: int, size: int, seed: int = 7) -> Workload:
    from vllm.v1.kv_offload.base import make_offload_key

    keys = [make_offload_key(hashlib.sha256(f"{seed}:{i}".encode()).digest(), 0) for i in range(blocks)]
    rng = np.random.default_rng(seed)
    requests = [keys[i : i + request_blocks] for i in range(0, blocks, request_blocks)]
    return Workload(requests, [rng.bytes(size) for _ in range(blocks)])


# --- the run ------------------------------------------------------------------------------------


def interleaved(repeats: int) -> list[str]:
    """The passes in order: the limit and the setups, rotated one place every repeat."""
    names = [LIMIT, *SETUPS]
    return [names[(r + i) % len(names)] for r in range(repeats) for i in range(len(names))]


def rows(passes: dict[str, list[Pass]], nbytes: int) -> list[Row]:
    """Per setup: store and load GB/s and lookup ms (medians) beside the limit's."""

    def med(name: str, fn: Callable[[Pass], float]) -> float:
        return statistics.median(fn(p) for p in passes[name])

    limit_store, limit_load = med(LIMIT, lambda p: p.store_s), med(LIMIT, lambda p: p.load_s)
    limit_lookup = med(LIMIT, lambda p: p.lookup_s)
    out = []
    for name in SETUPS:
        out += [
            Row(f"{name} store", gbps(nbytes, med(name, lambda p: p.store_s)), "GB/s",
                "pwrite per file, 16 threads", gbps(nbytes, limit_store)),
            Row(f"{name} restart lookup", med(name, lambda p: p.lookup_s) * 1e3, "ms",
                "os.stat per file", limit_lookup * 1e3, better="lower"),
            Row(f"{name} load", gbps(nbytes, med(name, lambda p: p.load_s)), "GB/s",
                "stat+preadv per file, 16 thr.", gbps(nbytes, limit_load)),
        ]  # fmt: skip
    return out


def checks(passes: dict[str, list[Pass]], blocks: int) -> dict[str, dict[str, Any]]:
    """Per setup (and the limit): whether every pass loaded every block byte for byte."""
    return {
        name: {
            "ok": all(p.equal == blocks for p in ps),
            "equal": [p.equal for p in ps],
            "missing": [p.missing for p in ps],
            "o_direct": ps[0].o_direct,
        }
        for name, ps in passes.items()
    }


def run(args: argparse.Namespace, base: Path) -> int:
    args.layout = Layout(args.layers, args.kv_heads, args.head_dim, args.block_tokens, args.block_bytes)
    work, model = workload(args.blocks, args.request_blocks, args.layout.size), base / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "bench": "vllm-tier"}')
    (model / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(4096))
    nbytes = args.blocks * args.layout.size
    head = f"{args.blocks} blocks of {args.layout.size} B ({nbytes / 1e6:.1f} MB) in requests of {args.request_blocks}"
    print(f"{head}, {args.repeats} repeats, page cache {args.page_cache}, in {base}", flush=True)
    passes: dict[str, list[Pass]] = {name: [] for name in (LIMIT, *SETUPS)}
    capacity = f"{max(256, 2 * args.repeats * nbytes >> 20)}MiB"  # every pass's objects stay
    with StoreProcess(base / "serve", "--host-capacity", capacity) as store:
        args.store_target = store.target
        for n, name in enumerate(interleaved(args.repeats)):
            root = base / f"{name.replace(' ', '-')}-{n}"
            root.mkdir(mode=0o700)
            one = _limit_pass(root, args, work) if name == LIMIT else _setup_pass(name, root, model, args, work)
            passes[name].append(one)
    found = checks(passes, args.blocks)
    print_rows(f"vLLM secondary tiers through TieringOffloadingManager ({nbytes / 1e6:.1f} MB, medians)",
               table := rows(passes, nbytes))  # fmt: skip
    for name, c in found.items():
        print(f"{name:<14} blocks equal per pass {c['equal']} of {args.blocks}, missing {c['missing']}"
              + ("" if c["o_direct"] is None else f", O_DIRECT {c['o_direct']}"))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.as_dict() for r in table], "checks": found}, indent=2))
    return 0 if all(c["ok"] for c in found.values()) else 1


def main(argv: list[str] | None = None) -> int:
    return command(_args(argv))


def command(args: argparse.Namespace) -> int:
    """The whole bench for parsed ``args`` (``main``, or ``kvstore bench vllm-tier``)."""
    size = Layout(args.layers, args.kv_heads, args.head_dim, args.block_tokens, args.block_bytes).size
    if size <= 0 or size % PAGE:
        print(f"error: --block-bytes (or the layout) gives {size} B a block: not a positive multiple of {PAGE}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.blocks < 1 or args.request_blocks < 1 or args.repeats < 1:
        print("error: --blocks, --request-blocks and --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-vllm-tier-", dir=args.dir) as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
