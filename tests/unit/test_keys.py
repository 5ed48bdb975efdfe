"""Keys (docs/architecture.md#object-keys): the chain, namespace separation, typed keys, determinism across processes.

The story: a prompt is cut into chunks, each chunk's hash chains over everything before it
inside a namespace that names the full computation identity.  Two processes, hosts or
restarts must compute the same bytes; two identities that could produce different KV must
never share a key; and a gap in the chain ends the usable prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.keys import (
    ROOT,
    ChunkHash,
    Identity,
    Namespace,
    ObjectKey,
    chunk_hashes,
    object_keys,
    tenant_mark,
    validate_chunk_size,
)

IDENT = Identity(
    model="tiny-llama",
    revision="abc123",
    kv_dtype="bf16",
    layout_id="cpu:LBHNC:bs128",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
)
NS = IDENT.namespace()
CHUNK = 8
TOKENS = list(range(1000, 1040))  # exactly five full chunks of 8


def hashes(tokens=TOKENS, ns=NS, **kw) -> list[ChunkHash]:
    return chunk_hashes(ns, tokens, CHUNK, **kw)


def first_difference(a: list, b: list) -> int:
    """Index of the first chunk whose hash differs (len when all shared ones agree)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- determinism across processes ---------------------------------------------------------


def fingerprint() -> str:
    """Everything keys.py derives from one fixed input, as hex lines (run here and in children)."""
    ns = Identity(
        model="tiny-llama",
        revision="abc123",
        kv_dtype="bf16",
        layout_id="cpu:LBHNC:bs128",
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        adapter="lora-x",
        scope="salt-1",
    ).namespace()
    hs = chunk_hashes(ns, list(range(50)), 16, extra_keys=[None, [b"img", "txt"]], include_partial=True)
    scoped = ns.scoped("tenant-a")
    keys = object_keys(scoped, chunk_hashes(scoped, list(range(32)), 16), tag="tp1-pp0")
    return "\n".join([ns.hex(), scoped.hex(), *(h.hex() for h in hs), *(bytes(k).hex() for k in keys)])


_CHILD = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('keys_fp', sys.argv[1]); "
    "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); "
    "print(hash('kvstore-seed-probe')); print(mod.fingerprint())"
)


def run_child(seed: str) -> tuple[str, str]:
    import kvstore

    root = str(Path(kvstore.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONHASHSEED": seed,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, __file__],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    probe, _, fp = out.partition("\n")
    return probe, fp.rstrip("\n")


def test_keys_are_identical_in_processes_with_different_hash_seeds():
    probe_a, fp_a = run_child("1")
    probe_b, fp_b = run_child("12345")
    assert probe_a != probe_b, "the children must really run with different str hash seeds"
    assert fp_a == fp_b == fingerprint()
    assert len(fp_a.splitlines()) == 2 + 4 + 2  # ns, scoped, 3 full + 1 partial, 2 keys


# ---- the namespace names the full identity ---------------------------------------------------

IDENTITY_CHANGES = {
    "model": {"model": "tiny-mistral"},
    "revision": {"revision": "def456"},
    "kv_dtype": {"kv_dtype": "fp16"},
    "layout_id": {"layout_id": "cuda:NHD:bs16"},
    "num_layers": {"num_layers": 5},
    "num_kv_heads": {"num_kv_heads": 4},
    "head_dim": {"head_dim": 128},
    "adapter": {"adapter": "lora-a"},
    "tp_size": {"tp_size": 2},
    "tp_rank": {"tp_rank": 1, "tp_size": 2},
    "pp_size": {"pp_size": 2},
    "pp_rank": {"pp_rank": 1, "pp_size": 2},
    "scope": {"scope": "cache-salt-1"},
    "weights": {"weights": "0f" * 16},
    "engine_config": {"engine_config": "e1" * 16},
    "weights_version": {"weights_version": "memory:step-42"},
}


def test_the_change_table_covers_every_identity_field():
    assert set(IDENTITY_CHANGES) == {f.name for f in dataclasses.fields(Identity)}


@pytest.mark.parametrize("change", IDENTITY_CHANGES.values(), ids=IDENTITY_CHANGES.keys())
def test_changing_any_identity_field_changes_namespace_and_every_chunk_key(change):
    other = dataclasses.replace(IDENT, **change).namespace()
    assert other != NS
    base, changed = hashes(ns=NS), hashes(ns=other)
    assert len(base) == len(changed) == 5
    assert set(base).isdisjoint(changed)
    assert set(object_keys(NS, base)).isdisjoint(object_keys(other, changed))


def test_all_identity_variants_have_pairwise_distinct_namespaces():
    namespaces = [NS] + [dataclasses.replace(IDENT, **c).namespace() for c in IDENTITY_CHANGES.values()]
    assert len(set(namespaces)) == len(namespaces)


def test_equal_identities_share_a_namespace():
    assert Identity(**dataclasses.asdict(IDENT)).namespace() == NS


@pytest.mark.parametrize(
    "namespaces",
    [
        pytest.param(
            lambda: [dataclasses.replace(IDENT, scope=s).namespace() for s in ("", "salt-a", "salt-b")], id="cache_salt"
        ),
        pytest.param(lambda: [NS, NS.scoped("tenant-a"), NS.scoped("tenant-b")], id="tenant"),
    ],
)
def test_a_different_salt_or_tenant_changes_every_chunk_key(namespaces):
    chains = [hashes(ns=ns) for ns in namespaces()]
    everything = [h for chain in chains for h in chain]
    assert len(set(everything)) == 3 * 5


def test_tenant_scoping_is_deterministic_and_typed():
    assert NS.scoped("tenant-a") == NS.scoped("tenant-a")
    assert type(NS.scoped("tenant-a")) is Namespace
    assert NS.scoped("tenant-a").scoped("tenant-b") != NS.scoped("tenant-b").scoped("tenant-a")
    with pytest.raises(ConfigError):
        NS.scoped("")


@pytest.mark.parametrize(
    "bad",
    [
        {"model": ""},
        {"kv_dtype": ""},
        {"layout_id": ""},
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 0},
        {"tp_size": 0},
        {"pp_size": 0},
        {"tp_rank": 1},
        {"pp_rank": -1},
        {"tp_rank": 2, "tp_size": 2},
    ],
)
def test_invalid_identities_are_config_errors(bad):
    with pytest.raises(ConfigError):
        dataclasses.replace(IDENT, **bad)


# ---- the chain -----------------------------------------------------------------------------


@pytest.mark.parametrize("pos", [0, 7, 8, 20, 31, 39])
def test_changing_a_token_changes_its_chunk_and_all_later_ones_only(pos):
    edited = list(TOKENS)
    edited[pos] += 1
    base, changed = hashes(), hashes(edited)
    chunk = pos // CHUNK
    assert changed[:chunk] == base[:chunk]
    assert all(b != c for b, c in zip(base[chunk:], changed[chunk:]))
    assert first_difference(base, changed) == chunk


@pytest.mark.parametrize("chunk", [0, 2, 4])
def test_extra_keys_of_a_chunk_change_it_and_all_later_ones(chunk):
    base = hashes()
    extra = [None] * chunk + [b"mm-item-hash"]
    changed = hashes(extra_keys=extra)
    assert changed[:chunk] == base[:chunk]
    assert all(b != c for b, c in zip(base[chunk:], changed[chunk:]))


@pytest.mark.parametrize(
    "a, b",
    [
        (b"img-a", b"img-b"),
        ([b"ab", b"c"], [b"a", b"bc"]),  # items are length-prefixed, never just concatenated
        ([b"x"], [b"x", b"x"]),
        (None, b""),
        ("caf\u00e9", "cafe"),
    ],
)
def test_different_extra_keys_give_different_chunks(a, b):
    assert hashes(extra_keys=[a])[0] != hashes(extra_keys=[b])[0]


def test_str_and_bytes_extra_keys_hash_alike():
    assert hashes(extra_keys=["img", ["a", b"b"]]) == hashes(extra_keys=[b"img", [b"a", b"b"]])


def test_a_gap_ends_the_hit_chunks_after_a_difference_never_match():
    """Only contiguous prefixes count: if chunk 2 differs, chunks 3.. cannot be found either."""
    stored = hashes()
    request = list(TOKENS)
    request[2 * CHUNK + 3] = 7  # only chunk 2's tokens differ; chunks 3 and 4 are identical
    assert request[3 * CHUNK :] == TOKENS[3 * CHUNK :]
    wanted = hashes(request)
    assert wanted[:2] == stored[:2]
    assert set(wanted[2:]).isdisjoint(stored)
    hit = next(i for i, h in enumerate(wanted) if h not in set(stored))
    assert hit == 2


def test_parent_continues_a_chain():
    whole = hashes()
    tail = chunk_hashes(NS, TOKENS[2 * CHUNK :], CHUNK, parent=whole[1])
    assert tail == whole[2:]
    assert hashes(parent=ROOT) == whole


@pytest.mark.parametrize(
    "tokens",
    [
        TOKENS,
        tuple(TOKENS),
        np.array(TOKENS, dtype=np.int64),
        np.array(TOKENS, dtype=np.uint32),
        np.array(TOKENS, dtype=np.int32),
    ],
    ids=["list", "tuple", "int64", "uint32", "int32"],
)
def test_token_containers_and_int_dtypes_hash_alike(tokens):
    assert hashes(tokens) == hashes()


# ---- chunking ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_tokens, include_partial, expected",
    [
        (0, False, 0),
        (0, True, 0),
        (7, False, 0),
        (7, True, 1),
        (8, False, 1),
        (8, True, 1),
        (40, False, 5),
        (40, True, 5),
        (41, False, 5),
        (41, True, 6),
        (47, True, 6),
    ],
)
def test_full_chunks_only_unless_the_partial_tail_is_asked_for(n_tokens, include_partial, expected):
    tokens = list(range(n_tokens))
    out = hashes(tokens, include_partial=include_partial)
    assert len(out) == expected
    full = hashes(tokens)
    assert out[: len(full)] == full


def test_a_partial_tail_never_collides_with_a_full_chunk():
    tokens = TOKENS[: 2 * CHUNK + 3]
    with_tail = hashes(tokens, include_partial=True)
    full = hashes(tokens)
    tail = with_tail[-1]
    assert len(with_tail) == 3 and tail not in full
    # the same three tokens after the same parent, hashed as a *full* chunk of size 3
    as_full = chunk_hashes(NS, tokens[2 * CHUNK :], 3, parent=full[-1])
    assert as_full[0] != tail
    # and a longer tail with the same first tokens is another key
    assert hashes(TOKENS[: 2 * CHUNK + 4], include_partial=True)[-1] != tail


@pytest.mark.parametrize(
    "chunk_size, block_size, ok",
    [
        (256, 16, True),
        (256, 128, True),
        (128, 128, True),
        (16, 1, True),
        (1, 1, True),
        (0, 16, False),
        (-16, 16, False),
        (100, 16, False),
        (64, 128, False),
        (16, 0, False),
        (16, -16, False),
    ],
)
def test_validate_chunk_size(chunk_size, block_size, ok):
    if ok:
        assert validate_chunk_size(chunk_size, block_size) is None
    else:
        with pytest.raises(ConfigError):
            validate_chunk_size(chunk_size, block_size)


@pytest.mark.parametrize("chunk_size", [0, -8])
def test_chunk_hashes_rejects_a_non_positive_chunk_size(chunk_size):
    with pytest.raises(ConfigError):
        chunk_hashes(NS, TOKENS, chunk_size)


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [0, 2**32],
        [5, 2**32 + 5],
        [2**64],
        np.array([-3], dtype=np.int64),
        [1.5, 2.0],
        np.array([[1, 2], [3, 4]]),
    ],
    ids=["negative", "2**32", "2**32+5", "2**64", "np-negative", "float", "2-d"],
)
def test_out_of_range_or_malformed_token_ids_are_config_errors(tokens):
    with pytest.raises(ConfigError):
        chunk_hashes(NS, tokens, 1)


def test_token_id_range_boundaries_are_accepted():
    low, high = chunk_hashes(NS, [0], 1), chunk_hashes(NS, [2**32 - 1], 1)
    assert low != high


# ---- hand computation of the documented byte layout ---------------------------------------


def test_chunk_hashes_match_a_hand_computation_of_the_documented_layout():
    ident = Identity(
        model="m",
        revision="r1",
        kv_dtype="bf16",
        layout_id="L",
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        adapter="a",
        scope="s",
        weights="w",
        engine_config="e",
        weights_version="memory:v",
    )
    fields = {
        "model": "m",
        "revision": "r1",
        "kv_dtype": "bf16",
        "layout_id": "L",
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "adapter": "a",
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "scope": "s",
        "weights": "w",
        "engine_config": "e",
        "weights_version": "memory:v",
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    ns = hashlib.sha256(b"kvstore/ns/v1\x00" + canonical).digest()
    assert ident.canonical() == canonical and ident.namespace() == ns

    tokens = [1, 2, 3, 4, 70000, 6]
    chunk0 = hashlib.sha256(
        b"kvstore/chunk/v1\x00"
        + ns
        + bytes(32)  # DOMAIN || namespace || ROOT
        + struct.pack("<BI", 0, 4)  # kind FULL, n_tokens
        + struct.pack("<4I", 1, 2, 3, 4)  # tokens, uint32 little-endian
        + struct.pack("<I", 3)
        + b"img"  # extra keys, length-prefixed
    ).digest()
    tail = hashlib.sha256(
        b"kvstore/chunk/v1\x00"
        + ns
        + chunk0
        + struct.pack("<BI", 1, 2)  # kind PARTIAL, 2
        + (70000).to_bytes(4, "little")
        + (6).to_bytes(4, "little")
    ).digest()
    got = chunk_hashes(ident.namespace(), tokens, 4, extra_keys=[b"img"], include_partial=True)
    assert [bytes(h) for h in got] == [chunk0, tail]
    assert ROOT == bytes(32)
    mark = hashlib.sha256(b"kvstore/tenant/v1\x00t1").digest()[:8]  # the tenant's mark first
    scoped = mark + hashlib.sha256(b"kvstore/ns/v1\x00tenant\x00t1\x00" + ns).digest()[8:]
    assert ident.namespace().scoped("t1") == scoped
    assert ident.namespace().scoped("t1").mark == tenant_mark("t1") == mark


# ---- ObjectKey -----------------------------------------------------------------------------

H0 = hashes()[0]


@pytest.mark.parametrize("tag", ["r0", "tp3-pp1", "layer_group-7", "X", "z" * 32])
def test_object_key_round_trips_through_bytes_and_printable(tag):
    key = ObjectKey(NS, H0, tag)
    assert bytes(key) == bytes(NS) + bytes(H0) + tag.encode()
    back = ObjectKey.from_bytes(bytes(key))
    assert back == key and type(back) is ObjectKey
    assert (back.namespace, back.chunk_hash, back.tag) == (NS, H0, tag)
    assert type(back.namespace) is Namespace and type(back.chunk_hash) is ChunkHash
    parsed = ObjectKey.parse(key.printable())
    assert parsed == key and parsed.printable() == key.printable()


@pytest.mark.parametrize("tag", ["r0", "z" * 32])
def test_printable_form_is_a_safe_file_name_and_redis_key(tag):
    text = ObjectKey(NS, H0, tag).printable()
    assert text == f"{NS.hex()}.{H0.hex()}.{tag}"
    assert len(text) <= 255 and "/" not in text and "\0" not in text
    assert set(text) <= set("0123456789abcdef.") | set(tag)
    assert text not in (".", "..") and not text.startswith(".")


def test_keys_differ_by_tag_and_by_chunk():
    keys = {ObjectKey(NS, h, t) for h in hashes()[:2] for t in ("r0", "r1")}
    assert len(keys) == 4


@pytest.mark.parametrize("tag", ["", "z" * 33, "a/b", "a.b", "a b", "r0\n", "caf\u00e9", "a\0", "../x"])
def test_invalid_tags_are_config_errors(tag):
    with pytest.raises(ConfigError):
        ObjectKey(NS, H0, tag)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        bytes(NS) + bytes(H0),
        bytes(NS) + bytes(H0)[:31],
        bytes(NS) + bytes(H0) + b"\xff",
        bytes(NS) + bytes(H0) + b"a/b",
        bytes(NS) + bytes(H0) + b"r0\n",
        bytes(NS) + bytes(H0) + b"z" * 33,
    ],
    ids=["empty", "no-tag", "short-hash", "non-ascii", "slash", "newline", "long-tag"],
)
def test_malformed_object_key_bytes_are_config_errors(raw):
    with pytest.raises(ConfigError):
        ObjectKey.from_bytes(raw)


GOOD = ObjectKey(NS, H0, "r0").printable()
NS_HEX, H_HEX, _ = GOOD.split(".")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "r0",
        f"{NS_HEX}.{H_HEX}",
        f"{NS_HEX}.{H_HEX}.r0.x",
        f"{NS_HEX}.{H_HEX}.",
        f"{NS_HEX[:-2]}.{H_HEX}.r0",
        f"{NS_HEX}.{H_HEX}00.r0",
        f"{NS_HEX[:-1]}g.{H_HEX}.r0",
        f"{NS_HEX.upper()}.{H_HEX}.r0",
        f"{NS_HEX[:2]} {NS_HEX[2:]}.{H_HEX}.r0",
        f" {GOOD}",
        f"{GOOD}\n",
        f"{NS_HEX}.{H_HEX}.a/b",
    ],
    ids=[
        "empty",
        "one-part",
        "two-parts",
        "four-parts",
        "empty-tag",
        "short-ns",
        "long-hash",
        "non-hex",
        "upper-case",
        "inner-space",
        "leading-space",
        "trailing-newline",
        "slash-tag",
    ],
)
def test_malformed_printable_keys_are_config_errors(text):
    with pytest.raises(ConfigError):
        ObjectKey.parse(text)


@pytest.mark.parametrize(
    "cls, raw",
    [
        (Namespace, bytes(31)),
        (Namespace, bytes(33)),
        (ChunkHash, b""),
        (ChunkHash, bytes(64)),
    ],
)
def test_digests_must_be_32_bytes(cls, raw):
    with pytest.raises(ConfigError):
        cls(raw)


@pytest.mark.parametrize("text", ["zz" * 32, "ab" * 31, "abc"])
def test_digest_fromhex_rejects_bad_hex(text):
    with pytest.raises(ConfigError):
        ChunkHash.fromhex(text)


def test_chunk_hash_and_namespace_are_distinct_types():
    assert not isinstance(NS, ChunkHash) and not isinstance(H0, Namespace)
    assert ChunkHash.fromhex(H0.hex()) == H0 and type(ChunkHash.fromhex(H0.hex())) is ChunkHash
    with pytest.raises(ConfigError):
        ObjectKey(ChunkHash(bytes(NS)), Namespace(bytes(H0)))  # swapped roles
    with pytest.raises(ConfigError):
        ObjectKey(bytes(NS), bytes(H0))  # untyped bytes
    assert repr(NS).startswith("Namespace(") and repr(H0).startswith("ChunkHash(")
