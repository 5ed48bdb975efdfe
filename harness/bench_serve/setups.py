"""The setups ``kvstore bench serve`` compares, and one setup's run of the workloads.

Host side, no vLLM import.  Each setup is one ``OpenAIServer`` (vLLM's OpenAI server, prefix
caching on) on the same model, started alone, sent every workload of the run in turn, and
stopped before the next setup starts:

  none     no connector, engine KV capped (``--num-gpu-blocks-override``): the correctness
           reference and the "no connector" column
  ours     our connector on the same capped KV, a host-DRAM budget smaller than the working
           set and an SSD directory behind it
  ours-hints  ours, with the client sending session hints (``connector.sessions``): the
           workloads that know their sessions (chat, restart, agent) say so per request
  ours-lru ours with plain LRU host retention: the baseline the retention targets name
  lmcache  LMCache 0.5.6 in multiprocess mode on the same capped KV: the recipe of
           ``kvstore bench e2e`` (``harness.bench_e2e.lmcache_peer``: installed when missing,
           its server started here for the setup's whole life, ``LMCacheMPConnector``)
  example  vLLM's ExampleConnector on the same capped KV (a directory of its own)
  limit    no connector, engine KV large enough for every session of the largest workload:
           nothing it needs is ever evicted

Each start of a server is followed by ``warm_up``: one short request, under one block, not
measured.  The hit counters come from the server's /metrics, read before and after each workload and
before each restart: vLLM's prompt tokens cached by source, our hit tokens by tier and load
decisions, each workload's own share.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from harness.bench_e2e import lmcache_peer
from harness.bench_serve.workload import Workload, WorkloadRun
from harness.openai_server import OpenAIServer

SETUPS = {
    "none": "no connector, engine KV capped (correctness reference)",
    "ours": "our connector, engine KV capped, host DRAM budget + SSD",
    "ours-hints": "ours, the client sending session hints (kv_transfer_params: session, continues, resume_in_s)",
    "ours-lru": "ours with plain LRU host retention (the baseline of the retention targets)",
    "lmcache": f"LMCache {lmcache_peer.LMCACHE_VERSION} multiprocess server, engine KV capped",
    "example": "vLLM ExampleConnector, engine KV capped",
    "limit": "no connector, engine KV large enough for every session (the limit)",
}
# /metrics families summed per label: (key in the report, metric, label)
COUNTERS = (
    ("vllm_cached_by_source", "vllm:prompt_tokens_cached_by_source_total", "source"),
    ("hit_tokens_by_tier", "vllm:kvstore_hit_tokens_by_tier_total", "tier"),
    ("decisions", "vllm:kvstore_load_decisions_total", "outcome"),
)
Counters = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Capacity:
    """Engine KV and our connector's budget, the same for every setup but ``limit``'s KV."""

    block_size: int = 128
    blocks: int = 40  # the capped engine KV, in blocks
    host_capacity: str = "32MiB"  # our connector's host-DRAM budget
    max_model_len: int = 2048
    limit: int = 208  # ``limit``'s engine KV, in blocks: enough for the largest workload

    @staticmethod
    def for_workloads(
        workloads: Sequence[Workload], block_size: int, blocks: int, host_capacity: str, max_model_len: int | None
    ) -> Capacity:
        """``max_model_len`` defaults to the longest sequence rounded up to whole blocks (vLLM
        refuses a max length the capped KV cannot hold)."""
        longest = max(w.longest() for w in workloads)
        limit = max([blocks] + [w.limit_blocks(block_size) for w in workloads])
        return Capacity(
            block_size, blocks, host_capacity, max_model_len or -(-longest // block_size) * block_size, limit
        )


@dataclass(slots=True)
class SetupRun:
    """One setup's run of one workload."""

    key: str
    run: WorkloadRun | None = None
    counters: Counters = field(default_factory=dict)
    startup_s: float = 0.0
    restarts: int = 0
    error: str | None = None


def make_server(key: str, model: Path, work: Path, cap: Capacity, lmcache_port: int | None = None) -> OpenAIServer:
    blocks = cap.limit if key == "limit" else cap.blocks
    args = [
        "--block-size",
        str(cap.block_size),
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-model-len",
        str(cap.max_model_len),
    ]
    connector = {"host_capacity": cap.host_capacity} if key.startswith("ours") else None
    if key == "ours-lru":
        connector = {"host_capacity": cap.host_capacity, "host_retention": "lru"}
    env = None
    if key == "example":
        args += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")},
                }
            ),
        ]
    if key == "lmcache":
        assert lmcache_port is not None, "the lmcache setup needs its server's port"
        args += ["--kv-transfer-config", json.dumps(lmcache_peer.connector_config(lmcache_port))]
        env = lmcache_peer.QUIET
    return OpenAIServer(model, work / key, name=key, connector=connector, args=args, env=env)


def read_counters(server: OpenAIServer) -> Counters:
    """The server's /metrics hit counters now (they restart at zero with it)."""
    return {key: dict(server.metric_by_label(metric, label)) for key, metric, label in COUNTERS}


def add_counters(into: Counters, now: Counters, base: Counters) -> None:
    """Add what the counters gained from ``base`` to ``now`` to ``into``."""
    for key, table in now.items():
        acc = into.setdefault(key, {})
        for value, n in table.items():
            acc[value] = acc.get(value, 0.0) + n - base.get(key, {}).get(value, 0.0)


def warm_up(server: OpenAIServer, block_size: int) -> None:
    """One short request (under one block: never cached, never stored), not measured, so the
    first measured request does not pay the fresh engine's first-batch costs."""
    server.stream(tuple(range(3, 3 + min(16, block_size - 1))), max_tokens=2)


def run_workload(key: str, server: OpenAIServer, workload: Workload, block_size: int) -> SetupRun:
    """One workload on a running server (restarted after round ``restart_after`` if set);
    a failure is kept as ``error``."""
    out = SetupRun(key)
    try:
        base = read_counters(server)

        def between(turn: int) -> None:
            nonlocal base
            if turn == workload.restart_after:
                add_counters(out.counters, read_counters(server), base)
                server.restart()
                warm_up(server, block_size)
                out.restarts += 1
                base = {}

        out.run = workload.run(server, between if workload.restart_after else None, hints=key == "ours-hints")
        add_counters(out.counters, read_counters(server), base)
    except Exception:  # noqa: BLE001 -- one workload's failure is reported beside the others
        out.error = traceback.format_exc() + "\n" + server.log_tail(2000)
    return out


def run_setup(
    key: str, model: Path, work: Path, cap: Capacity, workloads: Sequence[Workload], server: OpenAIServer | None = None
) -> list[SetupRun]:
    """Every workload in turn on one server of this setup (started and stopped here), or on
    ``server`` if given (left running): one ``SetupRun`` per workload.  A setup that fails to
    start has that error in each."""
    own = server is None
    with ExitStack() as stack:
        t0 = time.monotonic()
        try:
            port = _lmcache(stack, work) if key == "lmcache" and own else None
            if own:
                server = make_server(key, model, work, cap, port)
                stack.callback(server.stop)
                server.start()
            warm_up(server, cap.block_size)
        except Exception:  # noqa: BLE001 -- reported beside the other setups
            error = traceback.format_exc() + ("\n" + server.log_tail(2000) if server is not None else "")
            return [SetupRun(key, error=error) for _ in workloads]
        assert server is not None
        startup = time.monotonic() - t0
        runs = []
        for w in workloads:
            print(f"  {key} {w.name} ...", flush=True)
            runs.append(run_workload(key, server, w, cap.block_size))
            runs[-1].startup_s = startup
    return runs


def _lmcache(stack: ExitStack, work: Path) -> int:
    """LMCache by ``kvstore bench e2e``'s recipe: installed if missing, its server started for
    as long as ``stack`` lasts; the port."""
    lmcache_peer.ensure_lmcache()
    work.mkdir(parents=True, exist_ok=True)
    return stack.enter_context(lmcache_peer.lmcache_server(work / "lmcache-server.log"))
