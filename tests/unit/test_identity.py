"""The engine identity (connector.identity): every input that could change KV bytes changes
the namespace, and the same inputs give the same namespace.

The story: an engine is described by real vLLM config objects (``ModelConfig``,
``CacheConfig``, ``VllmConfig``, ``KVCacheConfig``) over a locally built model; changing
one vLLM setting, one byte of the weights or configs, or the hub revision must give a
namespace no other variant shares.  Hub revisions are resolved from HF cache trees built
in ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from connector import identity
from connector.identity import canonical_json, plain, resolve_hub, settings_digest, snapshot_commit, weights_identity
from kvstore.weights import digest_dir

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"


# ---- HF cache snapshots -----------------------------------------------------------------------


def hub_tree(
    cache: Path, repo: str = "org/name", refs: dict[str, str] | None = None, snapshots: dict[str, bytes] | None = None
) -> Path:
    """``cache/models--org--name/{refs/<ref>, snapshots/<commit>/{config.json, model.safetensors}}``."""
    base = cache / ("models--" + repo.replace("/", "--"))
    for ref, commit in (refs or {"main": COMMIT_A}).items():
        (base / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    for commit, weights in (snapshots or {COMMIT_A: b"weights-a"}).items():
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text('{"model_type": "llama"}')
        blob = base / "blobs" / f"{commit}-weights"
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(weights)
        (snap / "model.safetensors").symlink_to(blob)  # the HF cache's layout: links to blobs
    return base


@pytest.mark.parametrize(
    "path,commit",
    [
        (f"/x/models--org--name/snapshots/{COMMIT_A}", COMMIT_A),
        (f"/x/models--org--name/snapshots/{COMMIT_A}/", COMMIT_A),
        (f"/x/models--org--name/snapshots/{COMMIT_A[:39]}", None),  # not a full commit
        (f"/x/datasets--org--name/snapshots/{COMMIT_A}", None),
        (f"/x/models--org--name/other/{COMMIT_A}", None),
        ("/x/my-model", None),
    ],
)
def test_snapshot_commit_of_a_path(path, commit):
    assert snapshot_commit(Path(path)) == commit


def test_a_hub_id_resolves_refs_main_a_tag_or_a_commit(tmp_path):
    base = hub_tree(
        tmp_path / "hub", refs={"main": COMMIT_A, "v1": COMMIT_B}, snapshots={COMMIT_A: b"a", COMMIT_B: b"b"}
    )
    caches = [tmp_path / "empty", tmp_path / "hub"]  # the first holding the repo wins
    assert resolve_hub("org/name", None, caches) == (COMMIT_A, base / "snapshots" / COMMIT_A)
    assert resolve_hub("org/name", "v1", caches) == (COMMIT_B, base / "snapshots" / COMMIT_B)
    assert resolve_hub("org/name", COMMIT_B, caches) == (COMMIT_B, base / "snapshots" / COMMIT_B)
    assert resolve_hub("org/name", "v2", caches) is None  # no such ref
    assert resolve_hub("org/other", None, caches) is None
    assert resolve_hub("/abs/path", None, caches) is None


def test_a_ref_to_a_missing_snapshot_or_garbage_is_not_a_revision(tmp_path):
    hub_tree(tmp_path / "hub", refs={"main": COMMIT_B, "bad": "not a commit\n"})
    assert resolve_hub("org/name", None, [tmp_path / "hub"]) is None
    assert resolve_hub("org/name", "bad", [tmp_path / "hub"]) is None


def test_a_hub_id_gets_the_cached_commit_and_the_snapshot_digest(tmp_path, monkeypatch):
    base = hub_tree(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("KVSTORE_IDENTITY_CACHE", str(tmp_path / "sidecars"))
    rev, weights = weights_identity("org/name")
    assert rev == COMMIT_A and weights == digest_dir(base / "snapshots" / COMMIT_A)
    # vLLM's download_dir is searched first
    other = hub_tree(tmp_path / "dl", snapshots={COMMIT_A: b"other bytes"})
    assert weights_identity("org/name", download_dir=str(tmp_path / "dl")) == (
        COMMIT_A,
        digest_dir(other / "snapshots" / COMMIT_A),
    )


def test_a_snapshot_path_gives_its_commit_and_still_its_full_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_IDENTITY_CACHE", str(tmp_path / "sidecars"))
    snap = hub_tree(tmp_path / "hub") / "snapshots" / COMMIT_A
    assert weights_identity(str(snap)) == (COMMIT_A, digest_dir(snap))
    assert weights_identity(str(snap), revision="main") == (COMMIT_A, digest_dir(snap))
    plain_dir = tmp_path / "plain"
    shutil.copytree(snap, plain_dir)
    assert weights_identity(str(plain_dir)) == ("", digest_dir(snap))
    assert weights_identity(str(plain_dir), revision="v7") == ("v7", digest_dir(snap))


def test_a_model_nobody_can_read_here_shares_with_no_one_unless_a_revision_pins_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-xdg"))
    a, b = weights_identity("org/absent"), weights_identity("org/absent")
    assert a[0] == "" and a[1].startswith("unpinned-") and a != b
    assert weights_identity("org/absent", revision=COMMIT_B) == (COMMIT_B, "unverified")
    streamed = weights_identity(str(tmp_path), model_weights="s3://bucket/model")
    assert streamed[1].startswith("unpinned-")


# ---- canonical values -------------------------------------------------------------------------


class Color:
    def __repr__(self) -> str:
        return "<Color object at 0x7f00deadbeef>"


@pytest.mark.parametrize(
    "value,expected",
    [
        ({"b": 1, "a": [1.5, None, True]}, '{"a":[1.5,null,true],"b":1}'),
        ((1, 2), "[1,2]"),
        ({3, 1, 2}, "[1,2,3]"),
        (Color(), '"<Color object>"'),  # no memory address
        (json.dumps, '"json.dumps"'),
        (identity.enum.IntEnum("Mode", "NONE FP8")(2), '"Mode.FP8"'),
    ],
)
def test_canonical_json_is_deterministic(value, expected):
    assert canonical_json(value) == expected


def test_absent_settings_are_recorded_not_dropped():
    assert settings_digest({"calculate_kv_scales": None}) != settings_digest({})
    assert plain({"x": None}) == {"x": None}


# ---- every engine input changes the namespace (real vLLM config objects) ------------------------


@pytest.fixture(autouse=True)
def sidecars(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_IDENTITY_CACHE", str(tmp_path / "sidecars"))


@pytest.fixture(scope="module")
def vllm_cfg():
    """vLLM's config module (imported once: it takes ~10 s)."""
    import vllm.config

    return vllm.config


def make_engine(
    vllm_cfg,
    model_dir: Path,
    *,
    model: dict | None = None,
    cache: dict | None = None,
    attention: dict | None = None,
    load: dict | None = None,
    spec: dict | None = None,
    layout: str | None = None,
    after=None,
):
    """A real ``VllmConfig`` and ``KVCacheConfig`` for ``model_dir`` (4 layers, 2 KV heads x 64)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = vllm_cfg.ModelConfig(model=str(model_dir), skip_tokenizer_init=True, **(model or {}))
    vc = vllm_cfg.VllmConfig(
        model_config=mc,
        cache_config=vllm_cfg.CacheConfig(block_size=128, **(cache or {})),
        attention_config=vllm_cfg.AttentionConfig(**(attention or {})),
        load_config=vllm_cfg.LoadConfig(**(load or {})),
    )
    page = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **(spec or {}))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, page)], kv_cache_layout=layout
    )
    if after is not None:
        after(vc, kv)
    return vc, kv


def overrides(**kw) -> dict:
    return {"model": {"hf_overrides": kw}}


# field -> (how the engine is changed, the engine_settings key that must change)
SETTING_CHANGES = {
    "quantization": ({"after": lambda vc, kv: setattr(vc.model_config, "quantization", "fp8")}, "quantization"),
    "quantization_config": (
        {
            "after": lambda vc, kv: setattr(
                vc.model_config.hf_config, "quantization_config", {"quant_method": "fp8", "activation_scheme": "static"}
            )
        },
        "quantization_config",
    ),
    "model_dtype": ({"model": {"dtype": "float32"}}, "model_dtype"),
    "kv_cache_dtype": ({"cache": {"cache_dtype": "fp8"}}, "kv_cache_dtype"),
    "kv_scales": (
        {"after": lambda vc, kv: setattr(vc.cache_config, "calculate_kv_scales", True)},
        "calculate_kv_scales",
    ),
    "kv_dtype_skip_layers": ({"cache": {"kv_cache_dtype_skip_layers": ["0"]}}, "kv_cache_dtype_skip_layers"),
    "rope_scaling": (overrides(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    "rope_theta": (overrides(rope_theta=500000.0), "rope_theta"),
    "rope_parameters": (overrides(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "rope_parameters"),
    "sliding_window": (overrides(sliding_window=64), "sliding_window"),
    "disable_sliding_window": ({"model": {"disable_sliding_window": True}}, "disable_sliding_window"),
    "attention_backend": ({"attention": {"backend": "CPU_ATTN"}}, "attention_backend"),
    "kv_cache_layout": ({"layout": "LBNHC"}, "kv_cache_layout"),
    "kv_cache_spec": ({"spec": {"page_size_padded": 128 * 2 * 64 * 2 * 2 + 4096}}, "kv_cache_spec"),
    "hf_overrides": (overrides(kvstore_marker=1), "hf_overrides"),
    "model_impl": ({"model": {"model_impl": "transformers"}}, "model_impl"),
    "load_format": ({"load": {"load_format": "dummy"}}, "load_format"),
}
ENV_CHANGES = {  # field -> (environment variable, value, settings key)
    "model_runner": ("VLLM_USE_V2_MODEL_RUNNER", "1", "model_runner"),
    "batch_invariant": ("VLLM_BATCH_INVARIANT", "1", "batch_invariant"),
}
# settings keys varied by no case above, and why
NOT_VARIED = {
    "hf_config": "the effective HF config: moved by every hf_overrides case",
    "online_quantization_config": "online quantization arguments need a quantization method this CPU build accepts",
    "runner_type": "a pooling runner needs a pooling model",
    "convert_type": "a pooling conversion needs a pooling model",
    "attention_backend_per_kind": "changes with the backend map, recorded like attention_backend",
    "versions": "needs another vLLM or torch install",
    "kv_cache_groups": "set only for hybrid models (several KV cache groups); the Gemma-3-like engine "
    "test (tests/integration/test_hybrid_engine.py) runs one",
}


def identity_of(vllm_cfg, model_dir: Path, **change):
    vc, kv = make_engine(vllm_cfg, model_dir, **change)
    return identity.engine_identity(vc, kv)[0], identity.engine_settings(vc, kv)


def test_the_change_tables_cover_every_engine_setting(vllm_cfg, tiny_model):
    _, settings = identity_of(vllm_cfg, tiny_model)
    covered = {key for _, key in SETTING_CHANGES.values()} | {key for *_, key in ENV_CHANGES.values()}
    assert covered | set(NOT_VARIED) == set(settings)
    assert not covered & set(NOT_VARIED)


@pytest.mark.parametrize("field", SETTING_CHANGES)
def test_each_engine_setting_changes_the_namespace(vllm_cfg, tiny_model, field):
    change, key = SETTING_CHANGES[field]
    base, base_settings = identity_of(vllm_cfg, tiny_model)
    changed, settings = identity_of(vllm_cfg, tiny_model, **change)
    assert settings[key] != base_settings[key]
    assert changed.engine_config != base.engine_config
    assert changed.namespace() != base.namespace()


@pytest.mark.parametrize("field", ENV_CHANGES)
def test_each_engine_environment_setting_changes_the_namespace(vllm_cfg, tiny_model, monkeypatch, field):
    """Read where vLLM reads it, when the identity is made (V2 itself cannot start on this
    CPU build: vLLM refuses a config asking for it without Triton)."""
    var, value, key = ENV_CHANGES[field]
    monkeypatch.delenv(var, raising=False)
    vc, kv = make_engine(vllm_cfg, tiny_model)
    base, base_settings = identity.engine_identity(vc, kv)[0], identity.engine_settings(vc, kv)
    monkeypatch.setenv(var, value)
    changed, settings = identity.engine_identity(vc, kv)[0], identity.engine_settings(vc, kv)
    assert settings[key] != base_settings[key]
    assert changed.namespace() != base.namespace()


def test_all_setting_variants_have_pairwise_distinct_namespaces(vllm_cfg, tiny_model):
    variants = [identity_of(vllm_cfg, tiny_model)[0]]
    variants += [identity_of(vllm_cfg, tiny_model, **change)[0] for change, _ in SETTING_CHANGES.values()]
    assert len({v.namespace() for v in variants}) == len(variants)


def test_equal_engines_share_a_namespace(vllm_cfg, tiny_model):
    a, sa = identity_of(vllm_cfg, tiny_model)
    b, sb = identity_of(vllm_cfg, tiny_model)
    assert sa == sb and a == b and a.namespace() == b.namespace()
    assert a.weights == digest_dir(tiny_model) and a.revision == ""


def edit_middle(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    assert path.stat().st_size == size


FILE_CHANGES = {
    "weight_bytes": lambda d: edit_middle(d / "model.safetensors"),
    "config_bytes": lambda d: (d / "generation_config.json").write_text(
        json.dumps({**json.loads((d / "generation_config.json").read_text()), "kvstore": 1})
    ),
    "added_file": lambda d: (d / "special_tokens_map.json").write_text("{}"),
}


@pytest.mark.parametrize("field", FILE_CHANGES)
def test_changed_files_at_the_same_path_change_the_namespace(vllm_cfg, tiny_model, tmp_path, field):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    base, base_settings = identity_of(vllm_cfg, model)
    FILE_CHANGES[field](model)
    changed, settings = identity_of(vllm_cfg, model)
    assert changed.weights != base.weights and settings == base_settings
    assert changed.namespace() != base.namespace()


def test_the_revision_changes_the_namespace(vllm_cfg, tiny_model, tmp_path):
    base, _ = identity_of(vllm_cfg, tiny_model)
    pinned, _ = identity_of(vllm_cfg, tiny_model, model={"revision": COMMIT_B})
    assert pinned.revision == COMMIT_B and pinned.weights == base.weights
    assert pinned.namespace() != base.namespace()
    snaps = {}
    for commit in (COMMIT_A, COMMIT_B):  # one checkpoint, two hub commits
        snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / commit
        shutil.copytree(tiny_model, snap)
        snaps[commit] = identity.weights_identity(str(snap))
    assert snaps[COMMIT_A][1] == snaps[COMMIT_B][1] == base.weights
    assert snaps[COMMIT_A][0] != snaps[COMMIT_B][0]
