"""The setups ``kvstore bench serve`` compares, and one setup's run of the workload.

Host side, no vLLM import.  Each setup is one ``OpenAIServer`` (vLLM's OpenAI server, prefix
caching on) on the same model, started alone and stopped before the next one starts:

  none     no connector, engine KV capped (``--num-gpu-blocks-override``): the correctness
           reference and the "no connector" column
  ours     our connector on the same capped KV, a host-DRAM budget smaller than the working
           set and an SSD directory behind it
  example  vLLM's ExampleConnector on the same capped KV (a directory of its own)
  limit    no connector, engine KV large enough for every session: nothing is ever evicted

The hit counters come from the server's /metrics, read before each restart and at the end:
vLLM's prompt tokens cached by source, our hit tokens by tier and load decisions.
"""
from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from harness.bench_serve.workload import ChatRun, ChatSpec, Session, run_chat
from harness.openai_server import OpenAIServer

SETUPS = {
    "none": "no connector, engine KV capped (correctness reference)",
    "ours": "our connector, engine KV capped, host DRAM budget + SSD",
    "example": "vLLM ExampleConnector, engine KV capped",
    "limit": "no connector, engine KV large enough for every session (the limit)",
}
# /metrics families summed per label: (key in the report, metric, label)
COUNTERS = (("vllm_cached_by_source", "vllm:prompt_tokens_cached_by_source_total", "source"),
            ("hit_tokens_by_tier", "vllm:kvstore_hit_tokens_by_tier_total", "tier"),
            ("decisions", "vllm:kvstore_load_decisions_total", "outcome"))


@dataclass(frozen=True, slots=True)
class Capacity:
    """Engine KV and our connector's budget, the same for every setup but ``limit``'s KV."""

    block_size: int = 128
    blocks: int = 40  # the capped engine KV, in blocks
    host_capacity: str = "32MiB"  # our connector's host-DRAM budget
    max_model_len: int = 2048

    def limit_blocks(self, spec: ChatSpec) -> int:
        """Blocks enough to keep every session's whole history at once (and a spare each)."""
        per_session = -(-spec.longest() // self.block_size) + 1
        return max(self.blocks, spec.sessions * per_session)


@dataclass(slots=True)
class SetupRun:
    key: str
    run: ChatRun | None = None
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    startup_s: float = 0.0
    restarts: int = 0
    error: str | None = None


def make_server(key: str, model: Path, work: Path, cap: Capacity, spec: ChatSpec) -> OpenAIServer:
    blocks = cap.limit_blocks(spec) if key == "limit" else cap.blocks
    args = ["--block-size", str(cap.block_size), "--num-gpu-blocks-override", str(blocks),
            "--max-model-len", str(cap.max_model_len)]
    connector = {"host_capacity": cap.host_capacity} if key == "ours" else None
    if key == "example":
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}})]
    return OpenAIServer(model, work / key, name=key, connector=connector, args=args)


def read_counters(server: OpenAIServer, into: dict[str, dict[str, float]]) -> None:
    """Add the server's /metrics hit counters to ``into`` (they restart at zero with it)."""
    for key, metric, label in COUNTERS:
        table = into.setdefault(key, {})
        for value, n in server.metric_by_label(metric, label).items():
            table[value] = table.get(value, 0.0) + n


def run_setup(key: str, model: Path, work: Path, cap: Capacity, spec: ChatSpec, sessions: list[Session],
              restart_after: int | None = None, server: OpenAIServer | None = None) -> SetupRun:
    """One setup's run of the workload on a server of its own (started and stopped here), or
    on ``server`` if given (left running).  A failure is kept as ``error``."""
    out = SetupRun(key)
    own = server is None
    server = server or make_server(key, model, work, cap, spec)
    try:
        t0 = time.monotonic()
        if own:
            server.start()
        out.startup_s = time.monotonic() - t0

        def between(turn: int) -> None:
            if restart_after is not None and turn == restart_after:
                read_counters(server, out.counters)
                server.restart()
                out.restarts += 1

        out.run = run_chat(server, sessions, spec, between)
        read_counters(server, out.counters)
    except Exception:  # noqa: BLE001 -- one setup's failure is reported beside the others
        out.error = traceback.format_exc() + "\n" + server.log_tail(2000)
    finally:
        if own:
            server.stop()
    return out
