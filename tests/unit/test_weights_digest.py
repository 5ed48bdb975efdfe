"""The weight digest (kvstore.weights): every byte counts, and the sidecar is trusted only
while a file's path, device, inode, size, mtime and ctime are all unchanged.

The story: an engine restarted on updated weights at the same path, with the same sizes,
must get another namespace; an engine restarted on the same files must not rehash them.
``COUNTERS`` (bytes and files this process hashed) is the observable that tells a sidecar
hit from a rehash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import weights
from kvstore.weights import COUNTERS, PIECE_BYTES, digest_dir, model_files

MiB = 1 << 20
WEIGHTS = "model.safetensors"
SIZES = {"config.json": 700, WEIGHTS: 3 * MiB + 5, "tokenizer.json": 4000, "generation_config.json": 120}


def write_model(root: Path, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, size in SIZES.items():
        (root / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model(tmp_path / "model")


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "identity-cache"


def digest(root: Path, cache: Path, **kw) -> tuple[str, int, int]:
    """The digest and the bytes and files this call hashed.  ``racy_window_ns=0``: files
    written by the test a moment ago may be recorded (the default window is tested below)."""
    kw.setdefault("racy_window_ns", 0)
    before = COUNTERS.snapshot()
    out = digest_dir(root, cache_dir=cache, **kw)
    after = COUNTERS.snapshot()
    return out, after[0] - before[0], after[1] - before[1]


def edit_in_place(path: Path, offset: int, keep_mtime: bool = True) -> None:
    """Flip one byte without changing the size or inode; with ``keep_mtime`` the old mtime
    is forged back (``touch -r``-style).  The sleep steps past one clock tick of the
    filesystem's coarse timestamps: within one tick, only the racy window protects."""
    st = path.stat()
    time.sleep(0.02)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (st.st_ino, st.st_size)
    assert not keep_mtime or after.st_mtime_ns == st.st_mtime_ns


def total_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in model_files(root))


# ---- what is covered --------------------------------------------------------------------------


def test_the_covered_files_are_configs_code_weights_and_tokenizers_at_the_top_level(model):
    extra = [
        "modeling_custom.py",
        "tokenizer.model",
        "merges.txt",
        "pytorch_model.bin",
        "consolidated.pth",
        "model.gguf",
        "vocab.tiktoken",
        "weights.pt",
    ]
    for name in extra:
        (model / name).write_bytes(b"x")
    for name in ("README.md", "logo.png", ".gitattributes"):
        (model / name).write_bytes(b"y")
    (model / "original").mkdir()
    (model / "original" / "consolidated.00.pth").write_bytes(b"z")
    assert [p.name for p in model_files(model)] == sorted([*SIZES, *extra])


@pytest.mark.parametrize(
    "name,offset",
    [
        (WEIGHTS, 0),
        (WEIGHTS, SIZES[WEIGHTS] // 2),
        (WEIGHTS, SIZES[WEIGHTS] - 1),
        ("config.json", 350),
        ("generation_config.json", 0),
        ("tokenizer.json", 3999),
    ],
)
def test_one_byte_anywhere_in_a_covered_file_changes_the_digest(model, cache, name, offset):
    """Same size, same inode, mtime forged back: the sidecar must not be trusted (ctime)."""
    first, hashed, _ = digest(model, cache)
    assert hashed == total_bytes(model)
    edit_in_place(model / name, offset, keep_mtime=True)
    second, hashed, files = digest(model, cache)
    assert second != first
    assert (hashed, files) == (SIZES[name], 1)  # only the edited file was rehashed


def test_files_left_out_do_not_change_the_digest(model, cache):
    first = digest(model, cache)[0]
    (model / "README.md").write_text("new text")
    (model / "original").mkdir()
    (model / "original" / "consolidated.00.pth").write_bytes(b"other weights")
    assert digest(model, cache)[0] == first


def test_a_file_replaced_by_a_new_inode_with_the_old_size_and_mtime_is_rehashed(model, cache):
    first = digest(model, cache)[0]
    path = model / WEIGHTS
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tmp = model / "new.tmp"
    tmp.write_bytes(data)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    assert path.stat().st_ino != st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns
    second, hashed, files = digest(model, cache)
    assert second != first and (hashed, files) == (SIZES[WEIGHTS], 1)


def test_adding_or_renaming_a_covered_file_changes_the_digest(model, cache):
    first = digest(model, cache)[0]
    (model / "tokenizer.json").rename(model / "tokenizer2.json")
    renamed = digest(model, cache)[0]
    (model / "added_tokens.json").write_text("{}")
    assert len({first, renamed, digest(model, cache)[0]}) == 3


def test_pieces_and_threads_do_not_change_the_digest_but_every_piece_counts(tmp_path, cache):
    """A file of two pieces (64 MiB + 1 byte): the digest is the same on 1 and 4 threads,
    and a byte in the second piece changes it."""
    root = tmp_path / "big"
    root.mkdir()
    path = root / WEIGHTS
    with open(path, "wb") as f:
        f.truncate(PIECE_BYTES + 1)
    one = digest_dir(root, threads=1, cache_dir=tmp_path / "c1")
    four = digest_dir(root, threads=4, cache_dir=tmp_path / "c4")
    assert one == four
    edit_in_place(path, PIECE_BYTES, keep_mtime=True)
    assert digest_dir(root, threads=2, cache_dir=tmp_path / "c4", racy_window_ns=0) != one


# ---- the sidecar ------------------------------------------------------------------------------


def test_a_second_call_reads_the_sidecar_and_hashes_nothing(model, cache):
    first, hashed, files = digest(model, cache)
    assert (hashed, files) == (total_bytes(model), len(SIZES))
    assert len(list(cache.glob("*.json"))) == 1
    second, hashed, files = digest(model, cache)
    assert second == first and (hashed, files) == (0, 0)


def test_a_corrupt_sidecar_is_ignored_and_rewritten(model, cache):
    first = digest(model, cache)[0]
    (sidecar,) = cache.glob("*.json")
    for garbage in (
        b"{not json",
        json.dumps({"format": "other"}).encode(),
        json.dumps({"format": weights.DIGEST_FORMAT, "files": [{"key": [1]}]}).encode(),
        b"\xff\xfe",
    ):
        sidecar.write_bytes(garbage)
        again, hashed, _ = digest(model, cache)
        assert again == first and hashed == total_bytes(model)
    assert digest(model, cache)[1:] == (0, 0)  # rewritten whole


def test_a_forged_sidecar_entry_for_other_stamps_is_not_trusted(model, cache):
    """An entry is trusted only for its exact key: shift one field and it is a miss."""
    first = digest(model, cache)[0]
    (sidecar,) = cache.glob("*.json")
    doc = json.loads(sidecar.read_text())
    for entry in doc["files"]:
        entry["key"][5] += 1  # ctime_ns
        entry["digest"] = "0" * 32
    sidecar.write_text(json.dumps(doc))
    assert digest(model, cache)[:2] == (first, total_bytes(model))


def test_an_unwritable_cache_only_costs_a_rehash(model, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    first, hashed, _ = digest(model, blocker / "cache")
    assert digest(model, blocker / "cache")[:2] == (first, hashed)


def test_files_changed_within_the_racy_window_are_not_recorded(model, cache):
    """Default window (1 s): files written just now are hashed but not recorded, since a
    rewrite within one timestamp tick would keep every stamp."""
    first, hashed, _ = digest(model, cache, racy_window_ns=weights.RACY_WINDOW_NS)
    again, rehashed, _ = digest(model, cache, racy_window_ns=weights.RACY_WINDOW_NS)
    assert again == first and rehashed == hashed == total_bytes(model)


def test_the_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path / "explicit"))
    assert weights.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv(weights.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.cache_root() == tmp_path / "xdg" / "kvstore" / "identity"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert weights.cache_root() == Path.home() / ".cache" / "kvstore" / "identity"


# ---- across processes -------------------------------------------------------------------------

_CHILD = (
    "import sys; from kvstore.weights import digest_dir; "
    "print(hash('kvstore-seed-probe')); print(digest_dir(sys.argv[1], cache_dir=sys.argv[2]))"
)


def test_the_same_files_give_the_same_digest_in_other_processes(model, tmp_path):
    root = str(Path(weights.__file__).resolve().parents[1])
    outs = []
    for seed in ("1", "777"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(model), str(tmp_path / f"c{seed}")],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outs.append(proc.stdout.split())
    assert outs[0][0] != outs[1][0], "the children must run with different str hash seeds"
    assert outs[0][1] == outs[1][1] == digest_dir(model, cache_dir=tmp_path / "parent")
