"""The computation identity of an engine's KV (docs/architecture.md#object-keys): which weights, which revision,
which engine settings.  Runs in the engine's scheduler process, once at start.

Two engines that could produce different KV bytes must never share a namespace, and two
processes on the same files and settings must always share one (or every restart misses).
``engine_identity`` composes ``kvstore.keys.Identity`` from:

* ``weights``: a digest of every byte of the model directory's config and weight files
  (``kvstore.weights``), cached in a sidecar so a restart does not rehash;
* ``revision``: the hub commit, from an HF cache snapshot path, from the HF cache's refs
  for a hub id, or the ``revision`` given;
* ``engine_config``: a digest of the canonical JSON of ``engine_settings``, every engine
  setting that changes KV bytes (quantization, KV dtype and scales, RoPE, sliding window,
  attention backend and physical layout, ``hf_overrides``, the effective HF config, model
  runner and versions).  A setting that this vLLM lacks is recorded as ``null``, never
  dropped, so the key set is the same on every version.

A model whose weights cannot be read here (a hub id absent from every HF cache, or weights
streamed from object storage) and that no revision pins gets a namespace of its own
process: it can never serve or be served another engine's KV.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

from kvstore.keys import Identity
from kvstore.weights import digest_dir

log = logging.getLogger("kvstore.connector")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SETTINGS_FORMAT = "kvstore/engine-config/v1"


def engine_identity(vllm_config, kv_cache_config) -> tuple[Identity, int]:
    """The identity of this engine's KV and its canonical page size in bytes.

    Topology-free: under tensor parallelism each rank holds its share of the KV heads, and
    the objects hold all of them (``connector.transfer.Shard``), so the identity names the
    whole model's heads and page, never the rank or the TP size: engines of every TP size
    share the same objects.  MLA's latent KV is the same on every rank: its page is a rank's."""
    attn = attention_groups(kv_cache_config.kv_cache_groups)
    spec = attn[0].kv_cache_spec
    mc = vllm_config.model_config
    device = vllm_config.device_config.device_type if vllm_config.device_config else "cpu"
    ranks = tp_ranks(vllm_config, spec)
    heads = spec.num_kv_heads * ranks
    layout = f"{device}:bs{spec.block_size}:h{heads}x{spec.head_size}:{vllm_config.cache_config.cache_dtype}"
    revision, weights = weights_identity(
        str(mc.model),
        getattr(mc, "revision", None),
        str(getattr(mc, "model_weights", "") or ""),
        getattr(vllm_config.load_config, "download_dir", None),
    )
    settings = engine_settings(vllm_config, kv_cache_config)
    layers = sum(len(g.layer_names) for g in attn)  # recurrent layers: in their snapshots (engine_config)
    # the scheduler sees stage 0's layers only
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        layers = mc.get_total_num_hidden_layers()
    identity = Identity(
        model=str(mc.model),
        revision=revision,
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        layout_id=layout,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=spec.head_size,
        weights=weights,
        engine_config=settings_digest(settings),
    )
    log.info(
        "engine identity: model=%s revision=%s weights=%s engine_config=%s namespace=%s",
        identity.model,
        identity.revision or "-",
        identity.weights,
        identity.engine_config,
        identity.namespace().hex(),
    )
    return identity, spec.page_size_bytes * ranks


def is_state(spec) -> bool:
    """A recurrent layer's state (Mamba kind), not attention KV."""
    return type(spec).__name__ == "MambaSpec"


def attention_groups(groups) -> list:
    """The KV cache groups that hold attention KV (a recurrent hybrid's others hold states)."""
    return [g for g in groups if not is_state(g.kv_cache_spec)]


def is_mla(spec) -> bool:
    return type(spec).__name__.startswith("MLA")


def tp_ranks(vllm_config, spec) -> int:
    """How many TP ranks split each page (their KV heads); 1 for MLA (replicated)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    return 1 if is_mla(spec) else tp


def _canonical_spec(spec, ranks: int) -> dict[str, object]:
    """The KV cache spec of the whole model (per-rank head counts, and a recurrent state's
    channels, scaled by the TP size)."""
    fields = _fields(spec)
    for name in ("num_kv_heads", "num_head_slots"):
        count = fields.get(name)
        if isinstance(count, int) and ranks > 1:
            fields[name] = count * ranks
    fields.pop("max_tp_shards", None)  # how far this engine could shard: not the bytes
    if is_state(spec):
        axis = state_channel_axis()
        fields["shapes"] = [[n * ranks if i == axis else n for i, n in enumerate(shape)] for shape in spec.shapes]
        fields.pop("page_size_padded", None)  # vLLM pads to the attention page: not the state's bytes
    return {"type": type(spec).__name__, **fields}


def state_channel_axis() -> int:
    """The axis of a short convolution's state (one block's: (state_len, channels), or
    (channels, state_len) in vLLM's "DS" layout) that tensor parallelism splits."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return 0 if is_conv_state_dim_first() else 1


# ---- weights and revision ------------------------------------------------------------------


def weights_identity(
    model: str, revision: str | None = None, model_weights: str = "", download_dir: str | None = None
) -> tuple[str, str]:
    """``(revision, weights digest)`` of the model an engine loads (``model_config.model``,
    ``.revision``, ``.model_weights`` and ``load_config.download_dir``)."""
    given = revision or ""
    if model_weights and not Path(model_weights).is_dir():
        return given, _unpinned(given, f"weights streamed from {model_weights}")
    if Path(model).is_dir():
        digest = digest_dir(model)
        if model_weights and Path(model_weights).resolve() != Path(model).resolve():
            digest = hashlib.sha256(f"{digest}+{digest_dir(model_weights)}".encode()).hexdigest()[:32]
        return snapshot_commit(Path(model)) or given, digest
    found = resolve_hub(model, revision, hub_cache_dirs(download_dir))
    if found is not None:
        commit, snapshot = found
        return commit, digest_dir(snapshot)
    return given, _unpinned(given, f"{model} is in no HF cache here")


def _unpinned(revision: str, why: str) -> str:
    if revision:
        log.warning("engine identity: %s; trusting revision %r without a digest", why, revision)
        return "unverified"
    log.warning("engine identity: %s and no revision is given: this engine's KV is shared with no other process", why)
    return f"unpinned-{uuid.uuid4().hex}"


def snapshot_commit(path: Path) -> str | None:
    """The commit of an HF cache snapshot directory (``…/models--org--name/snapshots/<commit>``)."""
    parts = Path(os.path.abspath(path)).parts
    if (
        len(parts) >= 3
        and parts[-2] == "snapshots"
        and parts[-3].startswith("models--")
        and _COMMIT.fullmatch(parts[-1])
    ):
        return parts[-1]
    return None


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """Where HF hub snapshots may be, first match wins: vLLM's ``download_dir``, then
    ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/…``."""
    env = os.environ
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs = [
        download_dir,
        env.get("HF_HUB_CACHE"),
        os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None,
        os.path.join(xdg, "huggingface", "hub"),
    ]
    return [Path(d) for d in dict.fromkeys(dirs) if d]


def resolve_hub(model_id: str, revision: str | None, cache_dirs: list[Path]) -> tuple[str, Path] | None:
    """``(commit, snapshot dir)`` of hub model ``model_id`` at ``revision`` (default
    ``main``: a branch or tag read from ``refs/``, or a commit) in the first cache holding it."""
    if model_id.count("/") != 1 or model_id.startswith(("/", ".")):
        return None
    repo_dir = "models--" + model_id.replace("/", "--")
    rev = revision or "main"
    for cache in cache_dirs:
        repo = cache / repo_dir
        commit = rev if _COMMIT.fullmatch(rev) else _read_ref(repo / "refs" / rev)
        if commit and (repo / "snapshots" / commit).is_dir():
            return commit, repo / "snapshots" / commit
    return None


def _read_ref(path: Path) -> str | None:
    try:
        commit = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if _COMMIT.fullmatch(commit) else None


# ---- engine settings -----------------------------------------------------------------------


def engine_settings(vllm_config, kv_cache_config) -> dict[str, object]:
    """Every engine setting that changes KV bytes, as plain JSON values (the
    table of docs/connector.md#engine-identity).  Absent attributes are ``None``: recorded, not dropped."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = getattr(mc, "hf_config", None)
    text = getattr(mc, "hf_text_config", None) or hf
    attn = getattr(vllm_config, "attention_config", None)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    settings = {
        "quantization": getattr(mc, "quantization", None),
        "quantization_config": getattr(hf, "quantization_config", None),
        "online_quantization_config": getattr(mc, "quantization_config", None),
        "model_dtype": getattr(mc, "dtype", None),
        "kv_cache_dtype": getattr(cc, "cache_dtype", None),
        "calculate_kv_scales": getattr(cc, "calculate_kv_scales", None),
        "kv_cache_dtype_skip_layers": getattr(cc, "kv_cache_dtype_skip_layers", None),
        "rope_scaling": getattr(text, "rope_scaling", None),
        "rope_theta": getattr(text, "rope_theta", None),
        "rope_parameters": getattr(text, "rope_parameters", None),
        "sliding_window": getattr(text, "sliding_window", None),
        "disable_sliding_window": getattr(mc, "disable_sliding_window", None),
        "attention_backend": getattr(attn, "backend", None),
        "attention_backend_per_kind": getattr(attn, "backend_per_kind", None),
        "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None),
        "kv_cache_spec": _canonical_spec(spec, tp_ranks(vllm_config, spec)),
        # hybrid models: every KV cache group's spec and layers (the object holds them all)
        "kv_cache_groups": [
            {
                "layers": list(g.layer_names),
                "spec": _canonical_spec(g.kv_cache_spec, tp_ranks(vllm_config, g.kv_cache_spec)),
            }
            for g in groups
        ]
        if len(groups) > 1
        else None,
        "hf_overrides": getattr(mc, "hf_overrides", None),
        "hf_config": hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else hf,
        "model_impl": getattr(mc, "model_impl", None),
        "runner_type": getattr(mc, "runner_type", None),
        "convert_type": getattr(mc, "convert_type", None),
        "load_format": getattr(getattr(vllm_config, "load_config", None), "load_format", None),
        "model_runner": _model_runner(vllm_config),
        "batch_invariant": _vllm_env("VLLM_BATCH_INVARIANT"),
        "versions": _versions(),
    }
    if any(is_state(g.kv_cache_spec) for g in groups):  # recurrent hybrids: the state's layout
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        settings["conv_state_layout"] = get_conv_state_layout()
    return {k: plain(v) for k, v in settings.items()}


def settings_digest(settings: dict[str, object]) -> str:
    """32 hex characters of sha256 over the canonical JSON of ``settings``."""
    return hashlib.sha256(_SETTINGS_FORMAT.encode() + b"\x00" + canonical_json(settings).encode()).hexdigest()[:32]


def canonical_json(value: object) -> str:
    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def plain(value: object) -> object:
    """A deterministic JSON value for ``value``: enums by class and name, dtypes and other
    objects by ``str`` (memory addresses removed), callables by qualified name."""
    if isinstance(value, enum.Enum):  # before int: an IntEnum is recorded by name too
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=canonical_json)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **_fields(value)}
    if hasattr(value, "to_dict"):
        return plain(value.to_dict())
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return _ADDRESS.sub("", str(value))


def _fields(obj: Any) -> dict[str, object]:
    """``obj``: a dataclass instance of vLLM's (a KV cache spec)."""
    return {f.name: plain(getattr(obj, f.name, None)) for f in dataclasses.fields(obj)}


def _model_runner(vllm_config) -> str | None:
    try:
        v2 = vllm_config.use_v2_model_runner
    except (AttributeError, ValueError):
        return None
    return "v2" if v2 else "v1"


def _vllm_env(name: str) -> object:
    try:
        import vllm.envs as envs
    except ImportError:
        return None
    return getattr(envs, name, None)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for mod in ("vllm", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            out[mod] = None
    return out
