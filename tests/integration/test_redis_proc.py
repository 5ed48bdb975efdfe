"""Real redis-server processes from kvstore.testing.redis_proc and .redis_cluster: plain,
password/ACL, TLS, mutual TLS, memory limits, kill/restart, start-up failures, and a 3-node
cluster that survives a dead node."""

from __future__ import annotations

import gc
import os
import socket
import time

import pytest
import redis

from kvstore.errors import ConfigError, TierError
from kvstore.testing.redis_cluster import RedisClusterProcs
from kvstore.testing.redis_proc import HOST, RedisServer


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        try:
            s.connect((HOST, port))
        except ConnectionRefusedError:
            return True
    return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_plain_server_sets_gets_and_uses_the_defaults(redis_server):
    c = redis_server.client()
    assert c.set(b"k", b"\x00value\xff") is True
    assert c.get(b"k") == b"\x00value\xff"
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.url_with_auth == redis_server.url
    cfg = c.config_get("*")
    assert (cfg["save"], cfg["appendonly"], cfg["bind"]) == ("", "no", "127.0.0.1")
    assert (cfg["protected-mode"], cfg["daemonize"]) == ("no", "no")
    assert cfg["dir"] == str(redis_server.directory)
    assert cfg["logfile"] == str(redis_server.directory / "redis.log")
    assert (redis_server.directory / "redis.log").stat().st_size > 0
    assert redis_server.info("server")["tcp_port"] == redis_server.port
    c.close()


def test_password_server_refuses_anonymous_and_wrong_password(redis_factory):
    srv = redis_factory(password="s3cret")
    with pytest.raises(redis.AuthenticationError):
        srv.client(password=None).ping()
    with pytest.raises(redis.AuthenticationError):
        srv.client(password="wrong").ping()
    assert srv.client().ping() is True
    assert srv.url_with_auth == f"redis://:s3cret@127.0.0.1:{srv.port}/0"
    assert redis.Redis.from_url(srv.url_with_auth).ping() is True
    with open(f"/proc/{srv.pid}/cmdline", "rb") as f:  # the password is not visible in ps
        assert b"s3cret" not in f.read()
    assert (srv.directory / "redis.conf").stat().st_mode & 0o777 == 0o600


def test_acl_user_is_the_only_way_in(redis_factory):
    srv = redis_factory(username="alice", password='p@ss w"rd')
    with pytest.raises(redis.AuthenticationError):
        srv.client(username=None, password=None).ping()
    with pytest.raises(redis.AuthenticationError):  # the default user is disabled
        srv.client(username=None).ping()
    with pytest.raises(redis.AuthenticationError):
        srv.client(password="p@ss").ping()
    assert srv.client().acl_whoami() == "alice"
    assert srv.url_with_auth == f"redis://alice:p%40ss%20w%22rd@127.0.0.1:{srv.port}/0"
    assert redis.Redis.from_url(srv.url_with_auth).acl_whoami() == "alice"


def test_tls_server_needs_the_ca_and_refuses_plain_tcp(redis_factory, tls_files):
    srv = redis_factory(tls=tls_files)
    assert srv.url == f"rediss://127.0.0.1:{srv.port}/0"
    c = srv.client()
    assert c.set("k", b"tls") is True and c.get("k") == b"tls"
    assert srv.client(host="localhost").get("k") == b"tls"  # the certificate's DNS name
    assert srv.client().config_get("port") == {"port": "0"}  # no plain-TCP listener at all
    with pytest.raises(redis.ConnectionError):
        srv.client(ssl=False).ping()
    with pytest.raises(redis.ConnectionError):  # the system CAs do not know our CA
        srv.client(ssl_ca_certs=None).ping()


def test_mutual_tls_requires_a_client_certificate(redis_factory, tls_files):
    srv = redis_factory(tls=tls_files, tls_auth_clients=True)
    assert srv.client().ping() is True
    with pytest.raises(redis.ConnectionError):
        srv.client(ssl_certfile=None, ssl_keyfile=None).ping()
    assert srv.client().config_get("tls-auth-clients") == {"tls-auth-clients": "yes"}


def test_maxmemory_and_policy_are_applied(redis_factory):
    lru = redis_factory(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    c = lru.client()
    cfg = c.config_get("maxmemory*")
    assert (cfg["maxmemory"], cfg["maxmemory-policy"]) == ("4194304", "allkeys-lru")
    for i in range(100):
        assert c.set(f"k{i}", b"x" * 100_000) is True  # evicts instead of failing
    assert 0 < c.dbsize() < 100
    strict = redis_factory(maxmemory=4 * 1024 * 1024, maxmemory_policy="noeviction")
    assert strict.client().config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    c = strict.client()
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        for i in range(100):
            c.set(f"k{i}", b"x" * 100_000)


def test_kill_refuses_connections_and_restart_serves_on_the_same_port(redis_factory):
    srv = redis_factory()
    port, pid = srv.port, srv.pid
    srv.client().set("k", "v")
    srv.kill()
    assert srv.pid is None and _gone(pid) and _refused(port)
    srv.restart()
    assert srv.port == port and srv.pid not in (None, pid)
    assert srv.client().get("k") is None  # no RDB, no AOF: a fresh dataset
    assert srv.client().set("k", "again") is True


def test_appendonly_data_survives_a_graceful_restart(redis_factory):
    srv = redis_factory(appendonly=True)
    srv.client().set("k", b"durable")
    srv.restart()
    assert srv.client().get("k") == b"durable"


def test_bad_option_fails_at_once_with_the_log_tail(tmp_path):
    """The server's exit is seen (its log tail in the error), not waited out as a timeout."""
    srv = RedisServer(tmp_path, extra_args=["--no-such-option", "1"])
    with pytest.raises(TierError, match="no-such-option") as err:
        srv.start(timeout=600)
    assert "Bad directive" in str(err.value) and str(srv.port) in str(err.value)
    assert "timed out" not in str(err.value) and srv.pid is None


def test_a_given_port_in_use_is_an_error_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = RedisServer(tmp_path, port=port)
        with pytest.raises(TierError, match="Address already in use"):
            srv.start()
        assert srv.port == port and srv.pid is None


def test_a_picked_port_lost_to_a_race_is_replaced_once(tmp_path):
    srv = RedisServer(tmp_path)
    with socket.socket() as thief:  # someone takes the picked port before the server binds
        thief.bind((HOST, srv.port))
        thief.listen()
        lost = srv.port
        with srv:
            assert srv.port != lost and srv.client().ping() is True
    assert srv.pid is None and _refused(srv.port)


@pytest.mark.parametrize(
    "kw, names",
    [
        ({"username": "bob"}, "'bob'"),
        ({"maxmemory_policy": "lru-please"}, "'lru-please'"),
        ({"tls_auth_clients": True}, "tls_auth_clients"),
        ({"port": 70000}, "70000"),
        ({"port": 60000, "cluster": True}, "60000"),
    ],
)
def test_impossible_options_are_config_errors(tmp_path, kw, names):
    with pytest.raises(ConfigError, match=names):
        RedisServer(tmp_path, **kw)


def test_context_manager_and_garbage_collection_leave_no_process(tmp_path):
    with RedisServer(tmp_path / "a") as srv:
        pid, port = srv.pid, srv.port
        assert srv.client().ping() is True
    assert _gone(pid) and _refused(port)
    forgotten = RedisServer(tmp_path / "b").start()
    pid, port = forgotten.pid, forgotten.port
    del forgotten
    gc.collect()
    assert _gone(pid) and _refused(port)


def _cluster_info(node) -> dict:
    with node.client(decode_responses=True) as c:
        return c.cluster("INFO")


def _write_300(cluster: RedisClusterProcs) -> dict[str, bytes]:
    data = {f"key:{i}": f"value-{i}".encode() for i in range(300)}
    with cluster.client() as c:
        for k, v in data.items():
            assert c.set(k, v) is True
    return data


def test_cluster_spreads_keys_over_three_nodes(redis_cluster):
    assert len(redis_cluster.nodes) == 3
    assert redis_cluster.url == f"redis+cluster://127.0.0.1:{redis_cluster.nodes[0].port}"
    for node in redis_cluster.nodes:
        node.client().flushall()
        info = _cluster_info(node)
        assert (
            info["cluster_state"],
            info["cluster_slots_assigned"],
            info["cluster_known_nodes"],
            info["cluster_size"],
        ) == ("ok", "16384", "3", "3")
    data = _write_300(redis_cluster)
    sizes = [node.client().dbsize() for node in redis_cluster.nodes]
    assert min(sizes) > 0 and sum(sizes) == 300
    where = {}
    for i, node in enumerate(redis_cluster.nodes):
        for key in node.client().scan_iter(count=1000):
            where[key.decode()] = i
    assert set(where) == set(data)
    assert all(redis_cluster.node_of(k) == where[k] for k in data)
    assert redis_cluster.node_of(b"key:7") == where["key:7"]


def test_cluster_keeps_serving_when_a_node_dies(redis_cluster_factory):
    cluster = redis_cluster_factory()
    data = _write_300(cluster)
    owner = {k: cluster.node_of(k) for k in data}
    dead = 1
    cluster.kill(dead)
    survivors = [n for i, n in enumerate(cluster.nodes) if i != dead]
    deadline = time.monotonic() + 15  # until the survivors agree the node has failed
    while not all("fail" in _flags(n, cluster.nodes[dead].port) for n in survivors):
        assert time.monotonic() < deadline, "survivors never marked the dead node as failed"
        time.sleep(0.1)
    assert [_cluster_info(n)["cluster_state"] for n in survivors] == ["ok", "ok"]
    with cluster.client() as c:
        assert all(c.get(k) == v for k, v in data.items() if owner[k] != dead)
        for k in [k for k in data if owner[k] == dead][:3]:  # each costs a refused connect
            with pytest.raises(redis.ConnectionError):
                c.get(k)
    served = sum(n.client().dbsize() for n in survivors)
    assert served == sum(1 for k in data if owner[k] != dead) and 0 < served < 300
    cluster.restart(dead)  # rejoins with its slots, but without data (no RDB, no AOF)
    assert [_cluster_info(n)["cluster_state"] for n in cluster.nodes] == ["ok"] * 3
    back = next(k for k in data if owner[k] == dead)
    with cluster.client() as c:
        assert c.get(back) is None and c.set(back, b"again") is True and c.get(back) == b"again"
    assert cluster.nodes[dead].client().get(back) == b"again"


def _flags(node, port: int) -> list[str]:
    """The flags that ``node`` holds for the node on ``port`` (CLUSTER NODES)."""
    with node.client(decode_responses=True) as c:
        return c.cluster("NODES")[f"127.0.0.1:{port}"]["flags"].split(",")


def test_tls_cluster_with_an_acl_user(redis_cluster_factory, tls_files):
    cluster = redis_cluster_factory(tls=tls_files, tls_auth_clients=True, username="kv", password="pw")
    data = _write_300(cluster)
    sizes = [node.client().dbsize() for node in cluster.nodes]
    assert min(sizes) > 0 and sum(sizes) == 300
    with cluster.client() as c:
        assert all(c.get(k) == v for k, v in data.items())
    assert cluster.nodes[0].client().config_get("tls-cluster") == {"tls-cluster": "yes"}
