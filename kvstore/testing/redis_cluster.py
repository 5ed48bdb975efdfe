"""A Redis cluster of real ``redis-server`` processes on free ports, for tests and benchmarks.

Runs in the test or benchmark process and starts its own children (each a
``kvstore.testing.redis_proc.RedisServer``; see that module for the contract of one server).

Contract:
  * ``RedisClusterProcs(directory, n, **server_kw)`` owns n cluster-enabled masters without
    replicas in ``<directory>/node<i>``; the server options (password, username, tls, ...)
    apply to every node, and each node's port is picked here with its bus port free too.
  * ``start()`` creates the cluster (``redis-cli --cluster create``) and returns once every
    node reports ``cluster_state:ok`` with all 16384 slots assigned and all n nodes known;
    on any failure it stops every node and raises ``TierError``.
    ``cluster-require-full-coverage no`` keeps the surviving nodes serving their own slots
    when one dies; ``restart(i)`` brings node i back on its port and waits for the whole
    cluster again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
import redis.cluster

from kvstore.errors import ConfigError, TierError
from kvstore.testing.redis_proc import HOST, RedisServer

__all__ = ["RedisClusterProcs"]


class RedisClusterProcs:
    """n cluster-enabled masters (no replicas) in ``directory/node<i>``; options as for
    ``RedisServer`` (password, username, tls, ...) apply to every node."""

    def __init__(self, directory: Path, n: int = 3, **server_kw: Any) -> None:
        if n < 3:
            raise ConfigError(f"a Redis cluster needs at least 3 masters, got n={n}")
        if "port" in server_kw or "cluster" in server_kw:
            raise ConfigError("RedisClusterProcs picks each node's port and sets cluster=True")
        self.directory = Path(directory).resolve()
        self.nodes: list[RedisServer] = [
            RedisServer(self.directory / f"node{i}", cluster=True, **server_kw) for i in range(n)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterProcs:
        """Start every node, create the cluster, wait until every node sees it whole."""
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.start(timeout=max(deadline - time.monotonic(), 1.0))
            self._create(deadline)
            self._await_ok(deadline, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kw: Any) -> redis.cluster.RedisCluster:
        """A cluster client bootstrapped from every node still running."""
        live = [n for n in self.nodes if n.running] or self.nodes[:1]
        opts: dict[str, Any] = {
            "socket_connect_timeout": 2.0,
            "socket_timeout": 5.0,
            **self.nodes[0].connection_kwargs(),
            **kw,
        }
        return redis.cluster.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(HOST, n.port) for n in live], **opts)

    def node_of(self, key: bytes | str) -> int:
        """Index in ``nodes`` of the node that owns ``key``'s slot, per a live node's view."""
        node = next((n for n in self.nodes if n.running), None)
        if node is None:
            raise TierError("no node of the cluster is running")
        with node.client() as c:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            ranges = c.execute_command("CLUSTER SLOTS")
        ports = {n.port: i for i, n in enumerate(self.nodes)}
        for entry in ranges:
            lo, hi, master = int(entry[0]), int(entry[1]), entry[2]
            if lo <= slot <= hi:
                return ports[int(master[1])]
        raise TierError(f"slot {slot} of key {key!r} is not assigned to any node")

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Restart node i on its port (it rejoins from its nodes-PORT.conf); wait until every
        running node reports the cluster whole again."""
        self.nodes[i].restart(timeout)
        self._await_ok(time.monotonic() + timeout, timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcs:
        return self if any(n.running for n in self.nodes) else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _create(self, deadline: float) -> None:
        exe = shutil.which("redis-cli")
        if exe is None:
            raise TierError("the 'redis-cli' command is not on PATH")
        first, env = self.nodes[0], dict(os.environ)
        args = [
            exe,
            "--cluster",
            "create",
            *(f"{HOST}:{n.port}" for n in self.nodes),
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ]
        if first.password is not None:
            env["REDISCLI_AUTH"] = first.password  # not on the command line
        if first.username is not None:
            args += ["--user", first.username]
        if first.tls is not None:
            args += ["--tls", "--cacert", str(first.tls.ca_cert)]
            if first.tls_auth_clients:
                args += ["--cert", str(first.tls.client_cert), "--key", str(first.tls.client_key)]
        try:
            done = subprocess.run(
                args,
                env=env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=max(deadline - time.monotonic(), 1.0),
            )
        except subprocess.TimeoutExpired as err:
            raise TierError(f"redis-cli --cluster create timed out: {err.stdout!r}") from err
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise TierError(
                f"redis-cli --cluster create exited {done.returncode}:\n{(done.stdout + done.stderr).strip()[-1500:]}"
            )

    def _await_ok(self, deadline: float, timeout: float) -> None:
        want = {"cluster_state": "ok", "cluster_slots_assigned": "16384", "cluster_known_nodes": str(len(self.nodes))}
        pending = [n for n in self.nodes if n.running]
        last: dict[str, str] = {}
        while pending:
            try:
                with pending[0].client(socket_timeout=1.0, decode_responses=True) as c:
                    last = {k: str(v) for k, v in c.cluster("INFO").items()}
                if all(last.get(k) == v for k, v in want.items()):
                    pending.pop(0)
                    continue
            except (redis.ConnectionError, redis.TimeoutError) as err:
                last = {"error": str(err)}
            if time.monotonic() >= deadline:
                node = pending[0]
                raise TierError(
                    f"cluster node {node.host}:{node.port} not ready within "
                    f"{timeout:g} s: {last}; last log lines:\n{node.log_tail()}"
                )
            time.sleep(0.05)
