"""ServerConfig: precedence flags > KVSTORE_SERVE_* > YAML file > defaults, conversions, and
bad values that must name the key and where it came from."""

from pathlib import Path

import pytest

from kvstore.config import WritePolicy
from kvstore.errors import ConfigError
from kvstore.server.config import ServerConfig, split_listen

MiB, GiB = 1 << 20, 1 << 30


def test_defaults():
    cfg = ServerConfig.from_sources({}, env={})
    assert cfg == ServerConfig()
    assert cfg.host_capacity == 1 * GiB and cfg.max_object_bytes == 256 * MiB
    assert cfg.max_keys_per_call == 4096 and cfg.max_message_bytes == 8 * MiB
    assert cfg.put_ttl_s == cfg.lease_ttl == 30.0
    assert cfg.ssd_dir is None and cfg.auth_tokens is None and not cfg.tls


def test_precedence_flags_over_env_over_file(tmp_path):
    conf = tmp_path / "serve.yaml"
    conf.write_text(
        "host-capacity: 2GiB\nssd_capacity: 3GiB\nlease_ttl: 7\nlisten: 0.0.0.0:1\n"
        "max_keys_per_call: 10\ninsecure: true\n"
    )
    env = {"KVSTORE_SERVE_SSD_CAPACITY": "4GiB", "KVSTORE_SERVE_LEASE_TTL": "8", "KVSTORE_SERVE_CONFIG": str(conf)}
    flags = {"lease_ttl": "9", "ssd_dir": str(tmp_path), "redis": None}
    cfg = ServerConfig.from_sources(flags, env=env)
    assert cfg.host_capacity == 2 * GiB  # file only
    assert cfg.ssd_capacity == 4 * GiB  # env beats file
    assert cfg.lease_ttl == 9.0  # flag beats env and file
    assert cfg.listen == "0.0.0.0:1"
    assert cfg.max_keys_per_call == 10
    assert cfg.ssd_dir == Path(tmp_path)
    assert cfg.redis is None  # a flag left out (None) does not override


def test_config_flag_beats_env_config(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("frame_bytes: 64KiB\nmax_message_bytes: 1MiB\n")
    b.write_text("frame_bytes: 128KiB\n")
    cfg = ServerConfig.from_sources({"config": str(a)}, env={"KVSTORE_SERVE_CONFIG": str(b)})
    assert cfg.frame_bytes == 64 * 1024 and cfg.max_message_bytes == MiB


def test_env_conversions():
    env = {
        "KVSTORE_SERVE_METRICS_PORT": "0",
        "KVSTORE_SERVE_WRITE_POLICY": "host_only",
        "KVSTORE_SERVE_PUT_TTL": "2.5",
        "KVSTORE_SERVE_MAX_OBJECT_BYTES": "1MiB",
    }
    cfg = ServerConfig.from_sources({}, env=env)
    assert cfg.metrics_port == 0 and cfg.write_policy is WritePolicy.HOST_ONLY
    assert cfg.put_ttl_s == 2.5 and cfg.max_object_bytes == MiB


@pytest.mark.parametrize(
    "flags,env,needle",
    [
        ({"host_capacity": "lots"}, {}, "--host-capacity: cannot parse size 'lots'"),
        ({}, {"KVSTORE_SERVE_SSD_CAPACITY": "-3"}, "KVSTORE_SERVE_SSD_CAPACITY"),
        ({"lease_ttl": "soon"}, {}, "--lease-ttl: expected a number of seconds, got 'soon'"),
        ({"lease_ttl": "0"}, {}, "lease_ttl must be a positive number"),
        ({"lease_ttl": "60", "max_lease_ttl": "30"}, {}, "max_lease_ttl (30.0) is below lease_ttl (60.0)"),
        ({"metrics_port": "http"}, {}, "--metrics-port: expected an integer, got 'http'"),
        ({"metrics_port": "70000"}, {}, "metrics_port must lie in [0, 65535]"),
        ({"listen": "localhost"}, {}, "listen address 'localhost' must be HOST:PORT"),
        ({"listen": "h:99999"}, {}, "must be HOST:PORT with a port in [0, 65535]"),
        ({"tls_cert": "c.pem"}, {}, "tls_cert and tls_key must be given together"),
        ({"tls_client_ca": "ca.pem"}, {}, "tls_client_ca needs tls_cert"),
        ({"frame_bytes": "8MiB"}, {}, "max_message_bytes (8388608) must be at least frame_bytes + 64 KiB"),
        ({"max_object_bytes": "100"}, {}, "max_object_bytes must hold at least a 256-byte header"),
        ({"max_keys_per_call": "0"}, {}, "max_keys_per_call must be positive"),
        ({"max_unauthenticated_per_peer": "0"}, {}, "max_unauthenticated_per_peer must be positive"),
        ({}, {"KVSTORE_SERVE_MAX_UNAUTHENTICATED": "-1"}, "max_unauthenticated must be positive"),
        ({"request_timeout": "0"}, {}, "request_timeout must be a positive number"),
        ({}, {"KVSTORE_SERVE_HELLO_TIMEOUT": "0"}, "hello_timeout must be a positive number"),
        ({"bogus": "1"}, {}, "command line: unknown key 'bogus'"),
        ({}, {"KVSTORE_SERVE_WRITE_POLICY": "maybe"}, "KVSTORE_SERVE_WRITE_POLICY: 'maybe' is not one of"),
        ({"write_policy": "write_back"}, {}, "write_back: the store process writes through or not at all"),
    ],
)
def test_bad_values_are_named(flags, env, needle):
    with pytest.raises(ConfigError) as info:
        ServerConfig.from_sources(flags, env=env)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("host_capacity: 1GiB\nhost_capacty: 2GiB\n", "unknown key 'host_capacty'"),
        ("- a\n", "expected a mapping of settings, got list"),
        ("listen: [1, 2\n", "is not valid YAML"),
        ("listen: 5\n", "expected a string, got 5"),
    ],
)
def test_bad_files_are_named(tmp_path, text, needle):
    conf = tmp_path / "serve.yaml"
    conf.write_text(text)
    with pytest.raises(ConfigError) as info:
        ServerConfig.from_sources({"config": str(conf)}, env={})
    assert needle in str(info.value) and str(conf) in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="absent.yaml does not exist"):
        ServerConfig.from_sources({}, env={"KVSTORE_SERVE_CONFIG": str(tmp_path / "absent.yaml")})


def test_empty_file_is_all_defaults(tmp_path):
    conf = tmp_path / "empty.yaml"
    conf.write_text("")
    assert ServerConfig.from_sources({"config": str(conf)}, env={}) == ServerConfig()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("0.0.0.0:50051", ("0.0.0.0", 50051)),
        ("[::1]:7", ("[::1]", 7)),
        ("store.local:65535", ("store.local", 65535)),
    ],
)
def test_split_listen(text, expected):
    assert split_listen(text) == expected


@pytest.mark.parametrize("bad", [":50051", "host:", "host:-1", "[::1:5", "no-port"])
def test_split_listen_rejects(bad):
    with pytest.raises(ConfigError, match="listen address"):
        split_listen(bad)


def test_yaml_values_of_every_type(tmp_path):
    conf = tmp_path / "serve.yaml"
    conf.write_text(
        "host-capacity: 2GiB\nssd_dir: null\nlease_ttl: 12\nput_ttl: 1.5\nmetrics_port: 0\n"
        "write_policy: host_only\nredis: ''\nready_file: ready.txt\nmax_object_bytes: 1048576\n"
    )
    cfg = ServerConfig.from_sources({"config": str(conf)}, env={})
    assert (cfg.host_capacity, cfg.ssd_dir, cfg.lease_ttl) == (2 * GiB, None, 12.0)
    assert (cfg.put_ttl, cfg.metrics_port) == (1.5, 0)
    assert (cfg.write_policy, cfg.redis, cfg.ready_file, cfg.max_object_bytes) == (
        WritePolicy.HOST_ONLY,
        None,
        Path("ready.txt"),
        MiB,
    )


@pytest.mark.parametrize(
    "text,needle",
    [
        ("lease_ttl: soon\n", ": lease_ttl: expected a number of seconds, got 'soon'"),
        ("metrics_port: 1.5\n", ": metrics_port: expected an integer, got 1.5"),
        ("write_policy: sometimes\n", ": write_policy: 'sometimes' is not one of write_through"),
        ("ssd_dir: [a]\n", ": ssd_dir: expected a path, got ['a']"),
        ("lease_ttl: 9\nlease-ttl: 8\n", "'lease-ttl' repeats the setting 'lease_ttl'"),
        ("lease_ttl: 400\n", "max_lease_ttl (300.0) is below lease_ttl (400.0) (from "),
    ],
)
def test_bad_yaml_values_name_the_file_and_key(tmp_path, text, needle):
    conf = tmp_path / "serve.yaml"
    conf.write_text(text)
    with pytest.raises(ConfigError) as info:
        ServerConfig.from_sources({"config": str(conf)}, env={})
    assert needle in str(info.value) and str(conf) in str(info.value)


def test_each_prefix_is_read_by_its_own_side():
    """``KVSTORE_<KEY>`` is the connector's, ``KVSTORE_SERVE_<KEY>`` the store process's."""
    from connector.config import ConnectorConfig

    env = {"KVSTORE_LEASE_TTL": "5", "KVSTORE_SERVE_LEASE_TTL": "9", "KVSTORE_SERVE_HOST_CAPACITY": "2GiB"}
    assert ServerConfig.from_sources({}, env=env).lease_ttl == 9.0
    connector = ConnectorConfig.from_extra_config({}, env=env)
    assert (connector.lease_ttl, connector.host_capacity) == (5.0, GiB)


def test_a_refused_value_names_its_flag_or_variable():
    origins = r"below lease_ttl \(60.0\) \(from KVSTORE_SERVE_MAX_LEASE_TTL, --lease-ttl\)$"
    with pytest.raises(ConfigError, match=origins):
        ServerConfig.from_sources({"lease_ttl": "60"}, env={"KVSTORE_SERVE_MAX_LEASE_TTL": "30"})


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "10.1.2.3:1", "[::]:1", "store.example:1"])
def test_a_listen_address_beyond_loopback_needs_tls_and_tokens_or_insecure(tmp_path, listen):
    with pytest.raises(ConfigError, match="not loopback: serving it needs TLS .* and a tokens file"):
        ServerConfig(listen=listen)
    with pytest.raises(ConfigError, match="needs a tokens file"):
        ServerConfig(listen=listen, tls_cert=tmp_path / "c", tls_key=tmp_path / "k")
    with pytest.raises(ConfigError, match=r"needs TLS \(tls_cert, tls_key\);"):
        ServerConfig(listen=listen, auth_tokens=tmp_path / "t")
    assert ServerConfig(listen=listen, tls_cert=tmp_path / "c", tls_key=tmp_path / "k", auth_tokens=tmp_path / "t")
    assert ServerConfig(listen=listen, insecure=True).insecure


@pytest.mark.parametrize("listen", ["127.0.0.1:1", "localhost:1", "[::1]:1", "127.9.9.9:1"])
def test_loopback_needs_neither(listen):
    assert ServerConfig(listen=listen).listen == listen


def test_insecure_is_a_plain_flag():
    from kvstore.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--listen", "0.0.0.0:1", "--insecure"])
    flag_values = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    assert ServerConfig.from_sources(flag_values, env={}).insecure


def test_serve_flags_are_the_settings():
    """``kvstore serve`` has one flag per ServerConfig field, help from its doc, no defaults
    of its own (a flag left out falls through to the environment, the file, the default)."""
    from dataclasses import fields

    from kvstore.cli.main import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest: a for a in serve._actions if a.option_strings and a.dest not in ("help", "config")}
    assert set(flags) == {f.name for f in fields(ServerConfig)}
    assert all(a.default is None and a.help for a in flags.values())
    assert "(default 1GiB)" in flags["host_capacity"].help and "(default 30)" in flags["lease_ttl"].help
    args = parser.parse_args(["serve", "--host-capacity", "2GiB", "--put-ttl", "4", "--write-policy", "host_only"])
    flag_values = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    cfg = ServerConfig.from_sources(flag_values, env={"KVSTORE_SERVE_HOST_CAPACITY": "3GiB"})
    assert (cfg.host_capacity, cfg.put_ttl_s, cfg.write_policy) == (2 * GiB, 4.0, WritePolicy.HOST_ONLY)


def test_bounds_of_what_clients_hold_have_defaults_and_come_from_every_source():
    cfg = ServerConfig.from_sources({}, env={})
    assert (cfg.request_timeout, cfg.hello_timeout, cfg.max_unauthenticated_per_peer, cfg.max_unauthenticated) == (
        2.0,
        2.0,
        16,
        1024,
    )
    cfg = ServerConfig.from_sources(
        {"request_timeout": "0.5"},
        env={"KVSTORE_SERVE_HELLO_TIMEOUT": "3", "KVSTORE_SERVE_MAX_UNAUTHENTICATED_PER_PEER": "4"},
    )
    assert (cfg.request_timeout, cfg.hello_timeout, cfg.max_unauthenticated_per_peer) == (0.5, 3.0, 4)
