"""The store-level demo behind ``make run`` (until the engine connector drives it).

It plays a workload with shared prefixes — one system prompt reused by many requests, a
multi-turn conversation, a document asked about several times — against the embedded
default store (host DRAM + SSD directory).  Each request hashes its tokens, looks up the
contiguous hit, loads the hit chunks into one reused buffer and checks every byte, and
"computes" (synthesises) and stores the missing chunks.  Then a *new process* replays the
same workload on the same SSD directory: its host tier starts empty, so hits come from SSD.
The report gives hits with their denominators, bytes and throughput per tier.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvstore import codec
from kvstore.config import StoreConfig
from kvstore.keys import ROOT, Identity, chunk_hashes, object_keys
from kvstore.layout import format_bytes as format_size
from kvstore.store.tiered import TieredStore

CHUNK = 256
BLOCK = 16
IDENTITY = Identity(
    model="demo-llama-8l",
    revision="synthetic",
    kv_dtype="bf16",
    layout_id="demo:LBHNC:bs16",
    num_layers=8,
    num_kv_heads=8,
    head_dim=128,
)
# One page = one block of one layer: 16 tokens × 8 heads × (K+V) 128 dims × 2 bytes.
GEOMETRY = codec.ObjectGeometry(
    num_layers=8,
    pages_per_layer=CHUNK // BLOCK,
    page_bytes=BLOCK * 8 * 2 * 128 * 2,
    dtype="bf16",
    layout_id="demo:LBHNC:bs16",
    num_tokens=CHUNK,
)


def workload(seed: int = 7) -> list[tuple[str, np.ndarray]]:
    """(label, prompt tokens) for every request, in arrival order."""
    rng = np.random.default_rng(seed)
    toks = lambda n: rng.integers(0, 32000, n, dtype=np.uint32)  # noqa: E731
    system = toks(1024)
    reqs = [(f"support-{i}", np.concatenate([system, toks(300)])) for i in range(6)]
    convo = np.concatenate([system, toks(600)])
    for turn in range(3):
        reqs.append((f"chat-turn-{turn + 1}", convo))
        convo = np.concatenate([convo, toks(400), toks(300)])
    doc = toks(2048)
    reqs += [(f"doc-question-{i}", np.concatenate([doc, toks(100)])) for i in range(3)]
    return reqs


def synth_payload(chunk_hash: bytes, out: np.ndarray) -> np.ndarray:
    """Stand-in for the engine's KV of one chunk: a pattern unique to the chunk hash."""
    pattern = np.frombuffer(hashlib.sha256(chunk_hash).digest() * 2048, dtype=np.uint8)
    np.copyto(out.reshape(-1, pattern.size), pattern)
    return out


@dataclass
class PhaseReport:
    name: str
    requests: int = 0
    requests_hit: int = 0
    tokens_looked_up: int = 0
    tokens_hit: int = 0
    chunks_looked_up: int = 0
    chunks_hit: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    read_seconds: dict[str, float] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)
    verified_chunks: int = 0
    mismatched_chunks: int = 0
    seconds: float = 0.0


async def play(cfg: StoreConfig, name: str) -> PhaseReport:
    report = PhaseReport(name)
    ns = IDENTITY.namespace()
    size = codec.object_size(GEOMETRY)
    buf = np.empty(size, dtype=np.uint8)  # one reused load buffer
    expect = np.empty(GEOMETRY.payload_bytes, np.uint8)
    t0 = time.perf_counter()
    async with await TieredStore.from_config(cfg) as store:
        for _label, tokens in workload():
            hashes = chunk_hashes(ns, tokens, CHUNK)
            keys = object_keys(ns, hashes)
            found = await store.lookup(keys)
            await _load(store, keys, found.hits, buf, expect, report)
            for i in range(found.hits, len(keys)):
                parent = hashes[i - 1] if i else ROOT
                await store.put_payload(keys[i], GEOMETRY, synth_payload(hashes[i], expect), parent)
            _count_request(report, len(tokens), len(keys), found.hits)
        await store.drain()  # the write-throughs in flight land before the bytes are counted
        for tier in store.tiers:
            report.bytes_written[tier.name] = tier.stats().bytes_written
    report.seconds = time.perf_counter() - t0
    return report


async def _load(store, keys, hits, buf, expect, report) -> None:
    for key in keys[:hits]:
        got = await store.read_into(key, memoryview(buf))
        if got is None:  # evicted or damaged since the lookup: the engine would recompute
            report.mismatched_chunks += 1
            continue
        report.chunks_hit[got.tier] = report.chunks_hit.get(got.tier, 0) + 1
        report.bytes_read[got.tier] = report.bytes_read.get(got.tier, 0) + got.length
        report.read_seconds[got.tier] = report.read_seconds.get(got.tier, 0.0) + got.seconds
        body = buf[codec.HEADER_SIZE : got.length]
        ok = np.array_equal(body, synth_payload(key.chunk_hash, expect))
        report.verified_chunks += ok
        report.mismatched_chunks += not ok


def _count_request(report: PhaseReport, tokens: int, chunks: int, hits: int) -> None:
    report.requests += 1
    report.requests_hit += hits > 0
    report.tokens_looked_up += tokens
    report.tokens_hit += hits * CHUNK
    report.chunks_looked_up += chunks


def _pct(a: float, b: float) -> str:
    return f"{a:>6} / {b:<6} ({100.0 * a / b:5.1f}%)" if b else f"{a} / 0"


def format_report(r: PhaseReport) -> str:
    hit_chunks = sum(r.chunks_hit.values())
    lines = [
        f"== {r.name}: {r.requests} requests in {r.seconds:.2f} s",
        f"  token hit rate    {_pct(r.tokens_hit, r.tokens_looked_up)}  hit tokens / looked-up prompt tokens",
        f"  chunk hit rate    {_pct(hit_chunks, r.chunks_looked_up)}  hit chunks / looked-up full chunks",
        f"  request hit rate  {_pct(r.requests_hit, r.requests)}  requests with >=1 hit chunk / requests",
    ]
    for tier in sorted(set(r.bytes_read) | set(r.bytes_written)):
        nread, secs = r.bytes_read.get(tier, 0), r.read_seconds.get(tier, 0.0)
        rate = f"{nread / secs / 1e9:6.2f} GB/s" if secs else "     -    "
        lines.append(
            f"  tier {tier:<5} hits {r.chunks_hit.get(tier, 0):>4} chunks  read {format_size(nread):>11}"
            f" at {rate}"
            f"  written {format_size(r.bytes_written.get(tier, 0)):>11}"
        )
    verdict = "OK" if r.mismatched_chunks == 0 else "MISMATCH"
    lines.append(
        f"  loaded chunks byte-identical to what was stored: {r.verified_chunks} verified, "
        f"{r.mismatched_chunks} failed -> {verdict}"
    )
    return "\n".join(lines)


def _config(args, ssd_dir: Path) -> StoreConfig:
    return StoreConfig(host_capacity=args.host_capacity, ssd_dir=ssd_dir, ssd_capacity=args.ssd_capacity)


def run(args) -> int:
    if args.phase == "replay":
        report = asyncio.run(play(_config(args, Path(args.dir)), "engine 2: restarted process, cold host tier"))
        Path(args.report_json).write_text(json.dumps(asdict(report)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        ssd_dir = Path(args.dir) if args.dir else Path(tmp) / "ssd"
        first = asyncio.run(play(_config(args, ssd_dir), "engine 1: cold start, empty store"))
        print(format_report(first), flush=True)
        _drop_cache(ssd_dir)  # the restarted engine reads from disk, not from the page cache
        second = _replay_in_new_process(args, ssd_dir, Path(tmp) / "replay.json")
        print(format_report(second))
    bad = first.mismatched_chunks + second.mismatched_chunks
    ssd_hits = second.chunks_hit.get("ssd", 0)
    print(
        f"\nresult: {'PASS' if bad == 0 and ssd_hits > 0 else 'FAIL'} "
        f"({ssd_hits} chunks served from SSD after restart, {bad} bad loads)"
    )
    return 0 if bad == 0 and ssd_hits > 0 else 1


def _drop_cache(ssd_dir: Path) -> None:
    from tiers.ssd import drop_page_cache

    for path in ssd_dir.rglob("*.kv"):
        drop_page_cache(path)


def _replay_in_new_process(args, ssd_dir: Path, out: Path) -> PhaseReport:
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "demo",
        "--phase",
        "replay",
        "--dir",
        str(ssd_dir),
        "--report-json",
        str(out),
        "--host-capacity",
        str(args.host_capacity),
        "--ssd-capacity",
        str(args.ssd_capacity),
    ]
    subprocess.run(cmd, check=True)
    return PhaseReport(**json.loads(out.read_text()))
