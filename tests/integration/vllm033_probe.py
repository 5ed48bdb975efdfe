"""The connector's contract with a vLLM release other than the end-to-end engine's (0.33.0).

Run by ``tests/integration/test_vllm033_contract.py`` under that release's own Python
(``.venv-vllm033``, made by ``make vllm033``): ``python vllm033_probe.py MODEL_DIR WORK_DIR``
prints one JSON report on its last stdout line.  Every part is measured with vLLM's own
classes (its connector factory, base class, scheduler and config) and recorded, errors
included, so the test under the project's Python asserts on each part separately.

Parts:
  env        which vllm/torch were imported, the platform vLLM detected, and the exact error
             of its compiled ops (a CUDA wheel on a host without the CUDA driver);
  factory    ``KVConnectorFactory.create_connector`` for the scheduler and worker roles;
  abstract   for each abstract method of ``KVConnectorBase_V1``: the class that defines it
             on our connector's MRO;
  signatures for each method our class defines that the base also has: both signatures;
  gpu_worker / engine  where vLLM's GPU worker (model runner V2 and V1) and its ``LLM``
             engine stop on this host (exact errors);
  steps      vLLM's ``Scheduler`` with our connector (scheduler role) and a worker-role
             connector over CPU tensors in the flash-attention layout, driven step by step
             with fabricated ``ModelRunnerOutput``s: request "a" is computed (its KV filled
             with known values) and saved, then "a-again" (the same prompt) must be matched by
             our store and its blocks loaded with a's values.
"""

from __future__ import annotations

import inspect
import json
import socket
import sys
import time
import traceback
from pathlib import Path
from types import FunctionType

BLOCK_SIZE = 16  # vLLM's GPU block size
NUM_BLOCKS = 151  # covers max_model_len (2048 tokens); no other KV dimension equals it
PROMPT_TOKENS = 2 * 256 + 40  # two full 256-token chunks and a tail


def _error(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0] if str(exc) else "",
        "where": traceback.format_exception(exc)[-2].strip().splitlines()[0],
    }


def env_part() -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    out = {
        "vllm": vllm.__version__,
        "vllm_file": vllm.__file__,
        "torch": torch.__version__,
        "platform": type(current_platform).__name__,
        "device_type": current_platform.device_type,
        "cuda_available": torch.cuda.is_available(),
    }
    for ext in ("vllm._C", "vllm._C_stable_libtorch"):
        try:
            __import__(ext)
            out[ext] = "ok"
        except BaseException as exc:  # noqa: BLE001 - recorded: what stops on this host
            out[ext] = f"{type(exc).__name__}: {exc}"
    return out


def vllm_config(model_dir: str, work: Path):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, seed=0)
    vc = VllmConfig(
        model_config=model,
        # vLLM's own prefix cache off: a repeated prompt must reach the connector.
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=False, num_gpu_blocks_override=NUM_BLOCKS
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "chunk_size": 256,
                "host_capacity": "64MiB",
                "device": "host",
                "ssd_dir": str(work / "ssd"),
                "stats_path": str(work / "stats.json"),
            },
        ),
        device_config=DeviceConfig("cpu"),
    )
    return vc


def kv_cache_configs(vc):
    """The KV cache plan as vLLM 0.33's engine core makes it: the layout resolved from flash
    attention's supported layouts, the global groups, then the workers' and the scheduler's
    ``KVCacheConfig`` (one backing allocation; ``num_gpu_blocks_override`` fixes its blocks)."""
    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc = vc.model_config
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=torch.float32,
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_total_num_hidden_layers())}
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    layout = resolve_kv_cache_layout(vc, [layouts], specs.values())
    groups = get_global_kv_cache_groups(vc, [specs])
    workers = get_kv_cache_configs(vc, [specs], [1 << 30], groups)
    for w in workers:
        w.kv_cache_layout = vc.cache_config.kv_cache_layout
    scheduler = generate_scheduler_kv_cache_config(workers)
    vc.cache_config.num_gpu_blocks = scheduler.num_blocks
    return scheduler, workers[0], layout.name


def factory_part(vc, kcc) -> tuple[dict, dict]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    out, made = {}, {}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        try:
            c = KVConnectorFactory.create_connector(vc, role, kcc)
            made[role.name] = c
            out[role.name] = {"class": f"{type(c).__module__}.{type(c).__qualname__}", "role": c.role.name}
        except BaseException as exc:  # noqa: BLE001
            out[role.name] = {"error": _error(exc)}
    for c in made.values():
        c.shutdown()
    return out, made


def abstract_part() -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector.vllm import KVStoreConnector

    owners = {}
    for name in sorted(KVConnectorBase_V1.__abstractmethods__):
        owner = next((k for k in KVStoreConnector.__mro__ if name in vars(k)), None)
        owners[name] = None if owner is None else f"{owner.__module__}.{owner.__qualname__}"
    return {"abstract": owners, "still_abstract": sorted(getattr(KVStoreConnector, "__abstractmethods__", ()))}


def _describe(cls, name: str) -> dict:
    raw = inspect.getattr_static(cls, name)
    kind = type(raw).__name__  # function, classmethod, staticmethod, property
    if isinstance(raw, property):
        return {"kind": kind, "params": None}
    sig = inspect.signature(getattr(cls, name))
    return {"kind": kind, "params": [[p.name, p.kind.name] for p in sig.parameters.values()]}


def signatures_part() -> dict:
    """Every method our class defines that one of vLLM's classes on its MRO (the base and
    the ``Supports*`` mixins) also has: both signatures, and the vLLM class compared."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector.vllm import KVStoreConnector

    def method(cls, n):
        return isinstance(inspect.getattr_static(cls, n), (FunctionType, classmethod, staticmethod, property))

    bases = [k for k in KVStoreConnector.__mro__[1:] if k.__module__.startswith("vllm.")]
    compared = {}
    for n in sorted(vars(KVStoreConnector)):
        if (n.startswith("__") and n != "__init__") or not method(KVStoreConnector, n):
            continue
        base = next((k for k in bases if n in vars(k) and method(k, n)), None)
        if base is not None:
            compared[n] = {
                "ours": _describe(KVStoreConnector, n),
                "base": _describe(base, n),
                "base_class": base.__qualname__,
            }
    return {
        "compared": compared,
        "vllm_bases": [k.__qualname__ for k in bases],
        "base_methods": sorted(
            n for n in dir(KVConnectorBase_V1) if not n.startswith("_") and method(KVConnectorBase_V1, n)
        ),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Steps:
    """vLLM's scheduler with our scheduler-role connector, and on the worker side vLLM's
    own worker plumbing: a one-rank (gloo) distributed environment, the worker's connector
    agent (``ensure_kv_transfer_initialized``) and model runner V2's ``KVConnector``
    (``pre_forward`` / ``finish_forward`` / ``post_forward`` / ``no_forward``), over CPU
    tensors in flash attention's layout.  Only the forward is ours: per layer, the calls
    vLLM's attention wrapper (``maybe_transfer_kv_layer``) makes, around writing the
    scheduled tokens' KV."""

    def __init__(self, vc, kcc, worker_kcc, log: list) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector
        from vllm.v1.worker.utils import allocate_kv_cache

        self.vc, self.log = vc, log
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        log.append(
            f"scheduler built: {type(self.scheduler.connector).__module__}."
            f"{type(self.scheduler.connector).__qualname__}"
        )
        self.spec = kcc.kv_cache_groups[0].kv_cache_spec
        self.names = kcc.kv_cache_groups[0].layer_names
        # 0.33's own allocation, on the host: one buffer, each layer a [blocks, heads, tokens,
        # K|V channels] view in the resolved physical layout
        self.kv = allocate_kv_cache(
            worker_kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), [BLOCK_SIZE]
        )
        first = self.kv[self.names[0]]
        log.append(
            f"allocate_kv_cache: {vc.cache_config.kv_cache_layout} {list(first.shape)} strides {list(first.stride())}"
        )
        with set_current_vllm_config(vc):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
            initialize_model_parallel(1, 1)
            log.append("one-rank distributed environment (gloo)")
            ensure_kv_transfer_initialized(vc, worker_kcc)
        self.worker = get_kv_transfer_group()
        log.append(f"worker agent: {type(self.worker).__module__}.{type(self.worker).__qualname__}")
        self.runner_kv = get_kv_connector(vc, self.kv)  # calls register_kv_caches
        log.append(f"model runner V2 {type(self.runner_kv).__name__}: register_kv_caches ran")
        self.steps = 0
        self.external = {"queries": 0, "hits": 0}  # vLLM's connector prefix-cache stats, summed

    def page(self, token_block: int, layer: int):
        """The KV a model 'computes' for the prompt's block ``token_block`` (prefix-determined)."""
        import torch

        g = torch.Generator().manual_seed(1000 * layer + token_block)
        return torch.randn(self.kv[self.names[0]].shape[1:], generator=g)

    def forward(self, so) -> None:
        """The attention layers' connector calls around writing the scheduled tokens' KV."""
        blocks = {r.req_id: r.block_ids[0] for r in so.scheduled_new_reqs}
        done = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        for li, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            for rid, table in blocks.items():
                n = so.num_scheduled_tokens.get(rid, 0)
                for tb in range(done[rid] // BLOCK_SIZE, (done[rid] + n + BLOCK_SIZE - 1) // BLOCK_SIZE):
                    self.kv[name][table[tb]] = self.page(tb, li)
            self.worker.save_kv_layer(name, self.kv[name], None)

    def step(self) -> dict:
        """One engine step: ``schedule()``, the worker (as model runner V2 runs the connector)
        with a fabricated forward and sampled token, then ``update_from_output()``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput

        so = self.scheduler.schedule()
        kvc = self.runner_kv
        if not so.total_num_scheduled_tokens:
            mro = kvc.no_forward(so)
        else:
            kvc.pre_forward(so)
            with set_forward_context(None, self.vc):
                self.forward(so)
            kvc.finish_forward()
            out = kvc.post_forward(so.finished_req_ids)
            ids = list(so.num_scheduled_tokens)
            mro = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=out,
            )
        outputs = self.scheduler.update_from_output(so, mro)
        for eco in outputs.values():  # the stats vLLM's engine core reports (and its loggers count)
            ext = eco.scheduler_stats.connector_prefix_cache_stats if eco.scheduler_stats else None
            if ext is not None:
                self.external["queries"] += ext.queries
                self.external["hits"] += ext.hits
        self.steps += 1
        return {
            "new": {
                r.req_id: {"num_computed_tokens": r.num_computed_tokens, "blocks": list(r.block_ids[0])}
                for r in so.scheduled_new_reqs
            },
            "scheduled": dict(so.num_scheduled_tokens),
        }

    def run(self, request) -> dict:
        """Add a request and step until the scheduler holds nothing (saves delivered)."""
        self.scheduler.add_request(request)
        self.external = {"queries": 0, "hits": 0}
        first = None
        for _ in range(3000):  # bounded only so that a lost report cannot hang the probe
            s = self.step()
            first = first or s["new"].get(request.request_id)
            if not self.scheduler.has_requests():
                break
            if not s["scheduled"]:  # only waiting for the worker's saves: an idle engine loop
                time.sleep(0.01)
        return {
            "first_step": first,
            "steps": self.steps,
            "external": self.external,
            "pending": self.scheduler.has_requests(),
        }

    def close(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        ensure_kv_transfer_shutdown()
        self.scheduler.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


def make_request(rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), None)


def steps_part(vc, kcc, worker_kcc) -> dict:
    import torch

    log: list[str] = []
    out: dict = {"log": log}
    try:
        steps = Steps(vc, kcc, worker_kcc, log)
        tokens = [(37 * i + 11) % 1000 for i in range(PROMPT_TOKENS)]
        out["a"] = steps.run(make_request("a", tokens))
        log.append("request a ran")
        # "a" is finished, its saves reported and its blocks freed: wipe the KV cache, so
        # only a load from our store can bring a's KV back
        for t in steps.kv.values():
            t.zero_()
        out["a-again"] = again = steps.run(make_request("a-again", tokens))
        log.append("request a-again ran")
        first = again["first_step"]
        loaded = first["num_computed_tokens"] // BLOCK_SIZE
        same = all(
            torch.equal(steps.kv[n][first["blocks"][tb]], steps.page(tb, li))
            for li, n in enumerate(steps.names)
            for tb in range(loaded)
        )
        out["loaded_blocks_equal_saved"] = same if loaded else None
        # sleep mode (0.33): the worker drops its registrations, then restores them; the
        # store must still serve the prompt into the (wiped) KV cache after the wake-up
        steps.worker.unregister_kv_caches()
        steps.worker.restore_kv_caches()
        log.append("unregister_kv_caches, restore_kv_caches ran")
        for t in steps.kv.values():
            t.zero_()
        out["after-wake"] = woke = steps.run(make_request("after-wake", tokens))
        first = woke["first_step"]
        loaded = first["num_computed_tokens"] // BLOCK_SIZE
        out["after_wake_loaded_equal_saved"] = (
            all(
                torch.equal(steps.kv[n][first["blocks"][tb]], steps.page(tb, li))
                for li, n in enumerate(steps.names)
                for tb in range(loaded)
            )
            if loaded
            else None
        )
        steps.close()
        log.append("closed")
    except BaseException as exc:  # noqa: BLE001 - recorded: how far 0.33 ran
        out["error"] = _error(exc)
        out["traceback"] = traceback.format_exc()
    return out


def engine_part(model_dir: str, work: Path) -> dict:
    """How far vLLM's own engine (``LLM``, in-process) starts on this host with our connector."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=2048,
            distributed_executor_backend="uni",
            enable_prefix_caching=False,
            kv_cache_memory_bytes=1 << 28,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStoreConnector",
                kv_connector_module_path="connector.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"host_capacity": "64MiB", "ssd_dir": str(work / "ssd-engine")},
            ),
        )
        return {"started": True}
    except BaseException as exc:  # noqa: BLE001 - recorded: where 0.33 stops on this host
        return {"started": False, "error": _error(exc)}


def gpu_worker_part(vc) -> dict:
    """How far vLLM 0.33's GPU worker gets on this host, with each model runner."""
    import os

    from vllm.v1.worker.gpu_worker import Worker

    out = {}
    for runner, flag in (("v2", "1"), ("v1", "0")):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = flag
        stage = "constructor"
        try:
            worker = Worker(
                vc,
                local_rank=0,
                rank=0,
                is_driver_worker=True,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
            stage = "init_device"
            worker.init_device()
            out[runner] = {"stopped_at": None}
        except BaseException as exc:  # noqa: BLE001 - recorded: where 0.33 stops on this host
            out[runner] = {"stopped_at": stage, "error": _error(exc)}
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
    return out


def main(model_dir: str, work: str) -> dict:
    work_dir = Path(work)
    report: dict = {"env": env_part()}
    vc = vllm_config(model_dir, work_dir)
    kcc, worker_kcc, layout = kv_cache_configs(vc)
    report["env"]["kv_cache_layout"] = layout
    report["factory"], _ = factory_part(vc, kcc)
    report["abstract"] = abstract_part()
    report["signatures"] = signatures_part()
    report["steps"] = steps_part(vc, kcc, worker_kcc)
    report["gpu_worker"] = gpu_worker_part(vc)
    report["engine"] = engine_part(model_dir, work_dir)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2]), default=str))
