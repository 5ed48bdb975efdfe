"""The one settings converter and loader (kvstore.config), StoreConfig, and the connector's
ConnectorConfig: tables of cases, precedence, and bad input that must name the key and where
it came from.  The store process's ServerConfig has its own file (test_server_config.py)."""

import re
from dataclasses import fields
from enum import Enum
from pathlib import Path

import pytest
import torch

from connector.config import ConnectorConfig, DeviceKind, DeviceSpec
from connector.device import make_device
from kvstore.client.info import Transport
from kvstore.config import LeaseSettings, Seconds, Size, StoreConfig, TierSettings, WritePolicy, convert, parse_size
from kvstore.errors import ConfigError
from kvstore.server.config import ServerConfig
from tiers.redis_config import RedisConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64 kib", 64 * 1024),
        ("2TB", 2 * 10**12),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-5", "0", 0, -1, "1e9", True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="host_capacity"):
        parse_size(bad, "host_capacity")


# --- the one converter: each field type --------------------------------------------------------


@pytest.mark.parametrize(
    "tp,raw,expected",
    [
        (Size, "2MiB", 2 << 20),
        (Size, 4096, 4096),
        (Seconds, "2.5", 2.5),
        (Seconds, 3, 3.0),
        (float, "5000", 5000.0),
        (int, "42", 42),
        (int, 7, 7),
        (bool, "yes", True),
        (bool, "OFF", False),
        (bool, "1", True),
        (bool, False, False),
        (str, "redis://h", "redis://h"),
        (str, "", ""),
        (Path, "/var/kv", Path("/var/kv")),
        (Path, Path("rel"), Path("rel")),
        (WritePolicy, "host_only", WritePolicy.HOST_ONLY),
        (WritePolicy, WritePolicy.WRITE_BACK, WritePolicy.WRITE_BACK),
        (Transport, "shm", Transport.SHM),
        (Path | None, "", None),
        (Path | None, None, None),
        (Path | None, "/x", Path("/x")),
        (Seconds | None, "", None),
        (Seconds | None, "1.5", 1.5),
        (int | None, "0", 0),
    ],
)
def test_convert_each_type(tp, raw, expected):
    got = convert(tp, raw, "k")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "tp,raw,message",
    [
        (Size, "lots", "KEY: cannot parse size 'lots'"),
        (Size, "-1GiB", "KEY: cannot parse size '-1GiB'"),
        (Size, 0, "KEY must be positive, got 0"),
        (Seconds, "soon", "KEY: expected a number of seconds, got 'soon'"),
        (Seconds, "nan", "KEY: expected a finite number of seconds, got 'nan'"),
        (Seconds, True, "KEY: expected a number of seconds, got True"),
        (float, "inf", "KEY: expected a finite number, got 'inf'"),
        (int, "4.5", "KEY: expected an integer, got '4.5'"),
        (int, 4.0, "KEY: expected an integer, got 4.0"),
        (int, True, "KEY: expected an integer, got True"),
        (bool, "maybe", "KEY: expected true or false, got 'maybe'"),
        (str, 5, "KEY: expected a string, got 5"),
        (Path, 5, "KEY: expected a path, got 5"),
        (Path, "", "KEY: expected a path, got ''"),
        (WritePolicy, "sometimes", "KEY: 'sometimes' is not one of write_through, write_back, host_only"),
        (WritePolicy, "WRITE_THROUGH", "KEY: 'WRITE_THROUGH' is not one of"),
        (Transport, "udp", "KEY: 'udp' is not one of auto, shm, tcp, stream"),
        (Path | None, 3, "KEY: expected a path, got 3"),
    ],
)
def test_convert_names_the_key(tp, raw, message):
    with pytest.raises(ConfigError) as info:
        convert(tp, raw, "KEY")
    assert message in str(info.value)


# --- StoreConfig --------------------------------------------------------------------------------


def test_from_mapping_converts_and_reads_env(tmp_path):
    env = {"KVSTORE_SSD_CAPACITY": "2GiB", "KVSTORE_HOST_CAPACITY": "1GiB", "KVSTORE_SERVE_WRITE_POLICY": "host_only"}
    cfg = StoreConfig.from_mapping({"host_capacity": "512MiB", "ssd_dir": str(tmp_path)}, env=env)
    assert cfg.host_capacity == 512 * 2**20  # the mapping wins over the environment
    assert cfg.ssd_capacity == 2 * 2**30  # the environment fills the gap
    assert cfg.ssd_dir == Path(tmp_path)
    assert cfg.write_policy is WritePolicy.WRITE_THROUGH  # another prefix is not ours


def test_unknown_keys_are_named():
    known = "known: host_capacity, host_retention, ssd_capacity"
    with pytest.raises(ConfigError, match=f"config: unknown key 'ssd_dirr'; {known}"):
        StoreConfig.from_mapping({"ssd_dirr": "/tmp/x"}, env={})
    with pytest.raises(ConfigError, match="unknown keys 'a', 'b'"):
        StoreConfig.from_mapping({"a": 1, "b": 2}, env={})
    with pytest.raises(ConfigError, match="'ssd-dir' repeats the setting 'ssd_dir'"):
        StoreConfig.from_mapping({"ssd_dir": "/a", "ssd-dir": "/b"}, env={})


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"host_capacity": "lots"}, "config: host_capacity: cannot parse size 'lots'"),
        ({"ssd_capacity": -1}, "config: ssd_capacity must be positive"),
        ({"write_policy": "sometimes"}, "config: write_policy: 'sometimes' is not one of"),
        ({"lease_ttl": 30}, "unknown key 'lease_ttl'"),  # the embedded store takes no leases
        ({"chunk_size": 256}, "unknown key 'chunk_size'"),  # nor chunks: its callers do
    ],
)
def test_bad_values_name_the_key(values, needle):
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_mapping(values, env={})
    assert needle in str(info.value)


def test_a_refused_value_names_where_it_came_from():
    with pytest.raises(ConfigError, match=r"chunk_size 0 .*\(from KVSTORE_CHUNK_SIZE\)$"):
        ConnectorConfig.from_extra_config({}, env={"KVSTORE_CHUNK_SIZE": "0"})
    with pytest.raises(ConfigError, match=r"\(from kv_connector_extra_config: lease_ttl\)$"):
        ConnectorConfig.from_extra_config({"lease_ttl": "0"}, env={})


@pytest.mark.parametrize(
    "cls,field",
    [
        (StoreConfig, "write_policy"),
        (ConnectorConfig, "store_transport"),
        (ConnectorConfig, "device"),
        (ServerConfig, "write_policy"),
    ],
)
def test_modes_are_enums_never_free_strings(cls, field):
    """The constructors take typed values; only the loaders read strings."""
    with pytest.raises(ConfigError, match=f"{field}: expected a "):
        cls(**{field: "host"})


# --- shared field sets: declared once -----------------------------------------------------------


def test_shared_settings_are_declared_once_with_one_default():
    shared = {f.name: f.default for f in fields(TierSettings)} | {"lease_ttl": 30.0}
    for cls in (ConnectorConfig, ServerConfig):
        assert {f.name: f.default for f in fields(cls) if f.name in shared} == shared
        assert not set(cls.__annotations__) & set(shared)  # inherited, not re-declared
    assert ConnectorConfig().lease_ttl == ServerConfig().lease_ttl == LeaseSettings.lease_ttl == 30.0
    assert {f.name for f in fields(StoreConfig)} == {f.name for f in fields(TierSettings)}


def test_every_setting_has_a_doc():
    for cls in (StoreConfig, ConnectorConfig, ServerConfig):
        assert all(f.metadata.get("doc") for f in fields(cls)), cls


def _table_keys(doc: str) -> set[str]:
    """The keys in the first column of the settings table of reference page ``doc``."""
    rows = [line for line in (ROOT / doc).read_text().splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_every_documented_connector_key_is_read():
    keys = _table_keys("docs/reference/connector.md")
    assert keys == {f.name for f in fields(ConnectorConfig)}
    cfg = ConnectorConfig.from_extra_config(
        {
            "host_capacity": "64MiB",
            "ssd_dir": "/tmp/kv",
            "ssd_capacity": "1GiB",
            "chunk_size": "512",
            "device": "host",
            "verify_loads": "false",
            "prefill_tokens_per_s": "900",
            "explore_after_s": "7",
            "load_timeout_s": "5",
            "stats_path": "/tmp/s.json",
            "trace_path": "/tmp/t.json",
            "lease_ttl": "12",
            "store_target": "h:1",
            "store_token": "t",
            "store_tls_ca": "/ca.pem",
            "store_transport": "stream",
            "redis_url": "redis://r",
            "write_policy": "host_only",
            "host_retention": "lru",
            "lower_tiers_required": "off",
            "store_tls_cert": "/c.pem",
            "store_tls_key": "/k.pem",
            "encrypt_at_rest": "true",
            "kv_events_encoding": "array",
        },
        env={},
    )
    defaults = ConnectorConfig()
    assert all(getattr(cfg, k) != getattr(defaults, k) for k in keys - {"store_token_file", "keys_file", "mac_objects"})
    # mac_objects off is refused beside redis_url and encrypt_at_rest (tests/unit/test_lower.py)
    assert ConnectorConfig.from_extra_config({"mac_objects": "false"}, env={}).mac_objects != defaults.mac_objects
    from_file = ConnectorConfig.from_extra_config({"store_token_file": "/run/t"}, env={})
    assert from_file.store_token_file != defaults.store_token_file


def test_the_connector_config_never_shows_its_secrets(tmp_path):
    """Engines log their connector config: its repr masks the token and the Redis password."""
    cfg = ConnectorConfig.from_extra_config(
        {"store_token": "s3cret-tok", "store_target": "h:1", "redis_url": "rediss://user:pa55word@r:6380/0"}, env={}
    )
    assert "s3cret-tok" not in repr(cfg) and "pa55word" not in repr(cfg) and "pa55word" not in str(cfg)
    assert "store_token='***'" in repr(cfg) and "rediss://user:***@r:6380/0" in repr(cfg)
    assert cfg.bearer_token() == "s3cret-tok"
    (tmp_path / "t").write_text("tok-from-file\n")
    assert (
        ConnectorConfig.from_extra_config({"store_token_file": str(tmp_path / "t")}, env={}).bearer_token()
        == "tok-from-file"
    )
    assert ConnectorConfig.from_extra_config({}, env={"KVSTORE_STORE_TOKEN": "tok-env"}).bearer_token() == "tok-env"
    with pytest.raises(ConfigError, match="one way"):
        ConnectorConfig.from_extra_config({"store_token": "a", "store_token_file": "/f"}, env={})
    with pytest.raises(ConfigError, match="store_tls_cert and store_tls_key"):
        ConnectorConfig.from_extra_config({"store_tls_cert": "/c.pem"}, env={})


def test_every_documented_serve_key_is_read():
    assert _table_keys("docs/reference/store.md") == {f.name for f in fields(ServerConfig)}


def test_every_documented_redis_option_is_read(tmp_path):
    section = (ROOT / "docs/redis.md").read_text()
    text = section.split("Options (query parameters or keywords):", 1)[1].split("Mistakes", 1)[0]
    options = set(re.findall(r"`([a-z_]+)`", text)) - {"kvstore"}
    assert len(options) >= 12
    values = {
        "key_prefix": "p:",
        "ttl_s": "5",
        "pool_size": "3",
        "connect_timeout_s": "0.5",
        "op_timeout_s": "1",
        "part_size": "2MiB",
        "max_object_bytes": "8MiB",
        "max_inflight_parts": "2",
        "retry_s": "0.1",
        "orphan_ttl_s": "60",
        "tls_ca": "/ca",
        "tls_cert": "/c",
        "tls_key": "/k",
        "password_file": str(tmp_path / "redis.password"),
    }
    (tmp_path / "redis.password").write_text("pw\n")
    assert options <= set(values)
    RedisConfig.from_url("rediss://h", **{k: values[k] for k in options})


def test_documented_library_keys_are_store_keys():
    text = (ROOT / "docs/library.md").read_text().split("- Configuration keys (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`([a-z_]+)`", text)) == {f.name for f in fields(StoreConfig)}


# --- the connector ------------------------------------------------------------------------------


def test_connector_precedence_extra_over_env_over_defaults():
    env = {
        "KVSTORE_HOST_CAPACITY": "2GiB",
        "KVSTORE_LEASE_TTL": "7",
        "KVSTORE_SERVE_CHUNK_SIZE": "1024",
        "KVSTORE_VERIFY_LOADS": "no",
    }
    cfg = ConnectorConfig.from_extra_config({"host_capacity": "64MiB"}, env=env)
    assert cfg.host_capacity == 64 << 20  # extra config beats the environment
    assert (cfg.lease_ttl, cfg.verify_loads) == (7.0, False)  # the environment fills the gaps
    assert cfg.chunk_size == 256  # KVSTORE_SERVE_* belongs to the store process
    assert ConnectorConfig.from_extra_config(None, env={}) == ConnectorConfig()


def test_connector_shared_tier_keys_convert():
    cfg = ConnectorConfig.from_extra_config(
        {
            "store_target": "kvstore:50051",
            "store_tls_ca": "/etc/ca.pem",
            "store_transport": "stream",
            "redis_url": "redis://r:6379/0",
            "write_policy": "write_back",
            "lower_tiers_required": "no",
        },
        env={"KVSTORE_STORE_TOKEN": "t0k"},
    )
    assert (cfg.store_target, cfg.store_token, str(cfg.store_tls_ca)) == ("kvstore:50051", "t0k", "/etc/ca.pem")
    assert (cfg.store_transport, cfg.write_policy, cfg.lower_tiers_required) == (
        Transport.STREAM,
        WritePolicy.WRITE_BACK,
        False,
    )
    assert cfg.has_lower_tiers
    assert not ConnectorConfig.from_extra_config({}, env={}).has_lower_tiers


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"store_target": "localhost"}, "store_target: expected HOST:PORT"),
        ({"store_target": "a b:1"}, "store_target"),
        (
            {"store_transport": "udp"},
            "kv_connector_extra_config: store_transport: 'udp' is not one of auto, shm, tcp, stream",
        ),
        ({"write_policy": "write_around"}, "write_policy: 'write_around'"),
        ({"lower_tiers_required": "maybe"}, "lower_tiers_required: expected true or false"),
        ({"load_timeout_s": "0"}, "load_timeout_s must be a positive number of seconds"),
        ({"prefill_tokens_per_s": "-1"}, "prefill_tokens_per_s must be positive"),
        ({"store_token": 123}, "store_token: expected a string, got 123"),
        ({"chunk_size": "abc"}, "kv_connector_extra_config: chunk_size: expected an integer, got 'abc'"),
        ({"chunk_size": 0}, "chunk_size 0 must be a positive multiple"),
    ],
)
def test_connector_shared_tier_keys_reject(values, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ConnectorConfig.from_extra_config(values, env={})


def test_connector_env_errors_name_the_variable():
    with pytest.raises(ConfigError, match="KVSTORE_STORE_TRANSPORT: 'fast' is not one of auto, shm, tcp, stream"):
        ConnectorConfig.from_extra_config({}, env={"KVSTORE_STORE_TRANSPORT": "fast"})


# --- the copy device: an Enum kind plus options -------------------------------------------------


@pytest.mark.parametrize(
    "text,kind,options",
    [
        ("auto", DeviceKind.AUTO, ""),
        ("host", DeviceKind.HOST, ""),
        ("cuda", DeviceKind.CUDA, ""),
        ("emulated-cuda", DeviceKind.EMULATED_CUDA, ""),
        ("emulated-cuda:delay=0.01,fail_every=2", DeviceKind.EMULATED_CUDA, "delay=0.01,fail_every=2"),
        ("faulty:fail_every=3", DeviceKind.FAULTY, "fail_every=3"),
    ],
)
def test_device_spec(text, kind, options):
    spec = ConnectorConfig.from_extra_config({"device": text}, env={}).device
    assert isinstance(spec, DeviceSpec) and spec == text  # still the string make_device takes
    assert (spec.kind, spec.options) == (kind, options)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("gpu", "device: 'gpu' is not one of auto, host, cuda, emulated-cuda[:OPTIONS] or faulty:OPTIONS"),
        ("host:fast", "device: 'host:fast' is not one of"),
        ("faulty", "device: 'faulty' is not one of"),
        ("emulated-cuda:speed=3", "device: emulated-cuda device: unknown option 'speed'"),
        ("faulty:delay=-1", "device: faulty device: delay must not be negative"),
    ],
)
def test_device_spec_rejects(text, needle):
    with pytest.raises(ConfigError, match=re.escape(f"kv_connector_extra_config: {needle}")):
        ConnectorConfig.from_extra_config({"device": text}, env={})


def test_every_device_kind_makes_its_device():
    """``make_device`` switches on ``DeviceKind``: every kind the config accepts opens its own
    device (CUDA only where there is CUDA: without it, its clear error; ``auto`` is CUDA
    where there is CUDA, else host)."""
    cuda = torch.cuda.is_available()
    specs = {
        DeviceKind.AUTO: ("auto", "CudaDevice" if cuda else "HostDevice"),
        DeviceKind.HOST: ("host", "HostDevice"),
        DeviceKind.CUDA: ("cuda", "CudaDevice"),
        DeviceKind.EMULATED_CUDA: ("emulated-cuda", "EmulatedCudaDevice"),
        DeviceKind.FAULTY: ("faulty:fail_every=2", "FaultyDevice"),
    }
    assert set(specs) == set(DeviceKind) and all(isinstance(k, Enum) for k in DeviceKind)
    for kind, (text, name) in specs.items():
        if kind is DeviceKind.CUDA and not cuda:
            with pytest.raises(ConfigError, match="CUDA"):
                make_device(text)
            continue
        device = make_device(text)
        try:
            assert type(device).__name__ == name, (text, device)
        finally:
            device.close()
