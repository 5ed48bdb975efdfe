"""Authenticated objects (kvstore.integrity): MACs, tenant keys, rotation and the keys CLI."""

import json
import os
import stat

import numpy as np
import pytest

from kvstore import codec, integrity
from kvstore.cli import keys as keys_cli
from kvstore.cli.main import main
from kvstore.errors import ConfigError
from kvstore.integrity import ForgedObjectError
from kvstore.keys import ChunkHash, Namespace, ObjectKey

GEOMETRY = codec.ObjectGeometry(2, 4, 1024)
KEY = ObjectKey(Namespace(bytes(range(32))), ChunkHash(bytes(range(1, 33))), "r0")


def sealed(ring, key=KEY, seed=0):
    buf = bytearray(codec.object_size(GEOMETRY))
    payload = np.random.default_rng(seed).integers(0, 256, GEOMETRY.payload_bytes, dtype=np.uint8)
    codec.encode_into(buf, key, GEOMETRY, payload)
    if ring is not None:
        integrity.seal(buf, ring)
    return buf


def test_a_sealed_object_verifies_and_keeps_its_checksum():
    ring = integrity.new_deployment().keyring("team-a")
    buf = sealed(ring)
    assert integrity.check(buf, ring) == 1
    header = codec.verify(buf, expected_key=KEY)  # still a valid object: xxh3 untouched
    assert header.key_id == 1 and header.mac != bytes(16)


def test_a_tenants_key_never_verifies_another_tenants_object():
    dep = integrity.new_deployment()
    a, b = dep.keyring("a"), dep.keyring("b")
    assert a.keys[1] != b.keys[1]
    with pytest.raises(ForgedObjectError, match="MAC mismatch"):
        integrity.check(sealed(b), a)
    with pytest.raises(ForgedObjectError, match="MAC mismatch"):
        integrity.check(sealed(a), b)
    other = integrity.new_deployment().keyring("a")  # another deployment's tenant a
    with pytest.raises(ForgedObjectError):
        integrity.check(sealed(other), a)


def test_an_unsealed_or_rewritten_object_with_a_valid_checksum_is_refused():
    ring = integrity.new_deployment().keyring("a")
    with pytest.raises(ForgedObjectError, match="no MAC"):
        integrity.check(sealed(None), ring)
    buf = sealed(ring)
    header = codec.decode_header(buf)
    forged = bytearray(buf)
    forged[codec.HEADER_SIZE + 5] ^= 0xFF  # a payload byte changed...
    codec.encode_into(forged, KEY, GEOMETRY)  # ...with a valid checksum again
    codec.set_mac(forged, header.key_id, header.mac)  # and the old MAC copied over
    codec.verify(forged, expected_key=KEY)
    with pytest.raises(ForgedObjectError, match="MAC mismatch"):
        integrity.check(forged, ring)


@pytest.mark.parametrize("field", ["chunk_hash", "tag", "parent", "generated"])
def test_the_mac_binds_the_key_and_header_fields(field):
    ring = integrity.new_deployment().keyring("a")
    buf = sealed(ring)
    h = codec.decode_header(buf)
    import dataclasses

    if field == "chunk_hash":
        new = dataclasses.replace(h, key=ObjectKey(KEY.namespace, ChunkHash(bytes(32)), "r0"))
    elif field == "tag":
        new = dataclasses.replace(h, key=ObjectKey(KEY.namespace, KEY.chunk_hash, "r1"))
    elif field == "parent":
        new = dataclasses.replace(h, parent=ChunkHash(b"\x07" * 32))
    else:
        new = dataclasses.replace(h, generated=0, geometry=dataclasses.replace(h.geometry, num_tokens=5))
    buf[: codec.HEADER_SIZE] = codec.pack_header(new)
    codec.verify(buf)
    with pytest.raises(ForgedObjectError):
        integrity.check(buf, ring)


def test_the_namespace_is_not_covered_so_the_store_may_rekey_and_lz4_keeps_the_mac():
    ring = integrity.new_deployment().keyring("a")
    buf = sealed(ring)
    codec.rekey(buf, ObjectKey(Namespace(bytes(32)), KEY.chunk_hash, "r0"))
    assert integrity.check(buf, ring) == 1
    packed = codec.compress(buf)
    out = bytearray(len(buf))
    codec.decompress_into(packed, out)
    assert integrity.check(out, ring) == 1
    codec.rekey(out, KEY, clear_mac=True)
    assert codec.decode_header(out).key_id == 0


def test_rotation_keeps_old_objects_readable_until_their_key_is_retired(tmp_path):
    path = tmp_path / "keys.json"
    assert keys_cli.create(path)
    old = integrity.read_file(path).keyring("a")
    first = sealed(old)
    assert keys_cli.rotate(path) == 2
    ring = integrity.read_file(path).keyring("a")
    assert ring.current == 2 and integrity.check(first, ring) == 1  # old id still reads
    second = sealed(ring, seed=1)
    assert codec.decode_header(second).key_id == 2
    keys_cli.retire(path, 1)
    ring = integrity.read_file(path).keyring("a")
    with pytest.raises(ForgedObjectError, match="key id 1"):
        integrity.check(first, ring)
    assert integrity.check(second, ring) == 2
    with pytest.raises(ConfigError, match="current"):
        keys_cli.retire(path, 2)


def test_keys_cli_files_are_private_and_a_tenant_file_holds_only_its_keys(tmp_path, capsys):
    path, out = tmp_path / "d" / "keys.json", tmp_path / "a.keys"
    assert main(["keys", "create", "--file", str(path)]) == 0
    assert main(["keys", "create", "--file", str(path)]) == 0 and "kept" in capsys.readouterr().out
    assert main(["keys", "rotate", "--file", str(path)]) == 0
    assert main(["keys", "export", "--file", str(path), "--tenant", "team-a", "--out", str(out)]) == 0
    for p in (path, out):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    doc = json.loads(out.read_text())
    dep = integrity.read_file(path).deployment
    assert doc["tenant"] == "team-a" and doc["current"] == 2
    assert set(doc["keys"].values()).isdisjoint(s.hex() for s in dep.secrets.values())
    source = integrity.read_file(out)
    assert source.keyring().keys == dep.keyring("team-a").keys
    with pytest.raises(ConfigError, match="team-a"):
        source.keyring("team-b")
    assert main(["keys", "retire", "--file", str(path), "--id", "9"]) == 2
    secret = dep.secrets[1].hex()
    assert secret not in capsys.readouterr().out


def test_keys_come_from_a_file_the_environment_or_a_default_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSTORE_STATE_DIR", str(tmp_path / "state"))
    first = integrity.load_keys(None, env={})
    made = tmp_path / "state" / "keys.json"
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o600
    assert integrity.load_keys(None, env={}).keyring().keys == first.keyring().keys  # kept
    text = made.read_text()
    with caplog.at_level("WARNING"):
        from_env = integrity.load_keys(None, env={"KVSTORE_KEYS": text})
    assert "environment" in caplog.text and from_env.keyring().keys == first.keyring().keys
    with pytest.raises(ConfigError, match="not a kvstore keys file"):
        integrity.load_keys(None, env={"KVSTORE_KEYS": "nope"})
    assert repr(first.keyring()).count("ids=") == 1 and text.split('"1": "')[1][:16] not in repr(first.keyring())


def test_the_connector_reads_its_keys_file_and_keys_only_the_tiers_it_writes_itself(tmp_path):
    from connector.config import ConnectorConfig
    from connector.lower import keys_of

    deployment, tenant = tmp_path / "keys.json", tmp_path / "a.keys"
    keys_cli.create(deployment)
    keys_cli.export(deployment, "a", tenant)
    want = integrity.read_file(deployment).keyring("a")
    cfg = ConnectorConfig.from_extra_config({"ssd_dir": str(tmp_path / "ssd"), "keys_file": str(tenant)}, env={})
    assert keys_of(cfg)(KEY).keys == want.keys
    from_env = ConnectorConfig.from_extra_config({"redis_url": "redis://h"}, env={"KVSTORE_KEYS_FILE": str(tenant)})
    assert keys_of(from_env)(KEY).tenant == "a"
    assert keys_of(ConnectorConfig.from_extra_config({"store_target": "h:1"}, env={})) is None  # the store seals
    assert "a.keys" in repr(cfg) and want.keys[1].hex() not in repr(cfg)
    with pytest.raises(ConfigError, match="keys file"):
        keys_of(
            ConnectorConfig.from_extra_config({"ssd_dir": str(tmp_path), "keys_file": str(tmp_path / "no")}, env={})
        )
