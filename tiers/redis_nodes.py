"""Plumbing of the Redis tier (``tiers.redis``): which server holds a key, a circuit breaker
per server, and one counted command within the connection pool.

``RedisNodes`` is the base of ``RedisTier`` and runs on the event loop that opened the tier.
A *transport* failure (connection refused/reset, timeout) trips the breaker of the server it
was sent to and raises ``Down``; an error *reply* raises as redis-py raises it.  Commands go
out through a semaphore of ``pool_size`` (the pools hold two spare connections for breaker
probes), so the pool never runs dry.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import RedisCluster

from kvstore.errors import TierUnavailableError
from tiers.breaker import CircuitBreaker
from tiers.redis_config import RedisConfig
from tiers.redis_connect import TRANSPORT_ERRORS

CLUSTER = "cluster"  # the breaker for "no node known" in cluster mode
DOWN = object()  # a reply that never came: the node is down or its breaker open
NO_BREAKER = {
    k: 0.0
    for k in (
        "breaker_open",
        "breaker_opened",
        "breaker_closed",
        "breaker_rejected",
        "breaker_probes",
        "breaker_failures",
    )
}


class Down(Exception):
    """A command did not reach its server (its breaker has recorded the failure)."""


class RedisNodes:
    """Servers, breakers and counted commands of one Redis (or Redis Cluster) client."""

    def __init__(self, cfg: RedisConfig, client: Any) -> None:
        self.cfg = cfg
        self._client = client
        self._slots = asyncio.Semaphore(cfg.pool_size)  # commands in flight <= pool connections
        self._breakers: dict[str, CircuitBreaker] = {}
        self._round_trips = 0
        self._closed = False

    def breaker_stats(self) -> dict[str, float]:
        """The breakers' counters summed over servers (``breaker_open``: how many are open)."""
        out = dict(NO_BREAKER)
        for breaker in list(self._breakers.values()):
            for k, v in breaker.stats().items():
                out[k] += v
        return out

    async def _close_breakers(self) -> None:
        for breaker in self._breakers.values():
            await breaker.aclose()

    def _node(self, key: str) -> str:
        """The server holding ``key``: its breaker's name."""
        if not self.cfg.cluster:
            return self.cfg.address
        try:
            return self._client.get_node_from_key(key).name
        except (rx.RedisClusterException, rx.RedisError):
            return CLUSTER

    def _breaker(self, node: str) -> CircuitBreaker:
        breaker = self._breakers.get(node)
        if breaker is None:
            breaker = CircuitBreaker(f"redis {node}", lambda: self._probe(node), retry_s=self.cfg.retry_s)
            self._breakers[node] = breaker
        return breaker

    def _allow(self, node: str) -> bool:
        if self._closed:
            raise TierUnavailableError(f"redis tier {self.cfg.redacted_url} is closed")
        return self._breaker(node).allow()

    async def _probe(self, node: str) -> None:
        async with asyncio.timeout(self.cfg.connect_timeout_s + self.cfg.op_timeout_s):
            if not self.cfg.cluster:
                await self._client.ping()
            elif node == CLUSTER:
                await self._client.ping(target_nodes=RedisCluster.RANDOM)
            else:
                target = self._client.get_node(node_name=node)
                if target is None:
                    raise LookupError(f"{node} is no longer a cluster node")
                await self._client.ping(target_nodes=target)

    async def _call(self, node: str, fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        """One command or pipeline: counted, within the pool; transport failures trip the
        node's breaker and raise ``Down``, error replies raise as they are."""
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        async with self._slots:
            self._round_trips += 1
            try:
                result = await fn(*args, **kw)
            except TRANSPORT_ERRORS as err:
                self._breaker(node).failure(err)
                raise Down(node) from err
        if task is not None and task.cancelling() > cancels:
            # redis-py's asyncio.wait_for (Python 3.11) can swallow a cancellation that
            # arrives just as a send completes: honour it here.
            raise asyncio.CancelledError()
        return result

    async def _refresh_slots(self) -> None:
        """A fresh slot map from the cluster (after a MOVED seen on the bulk path, which
        redis-py never saw), keeping redis-py's connections; a failure leaves the old map."""
        if not self.cfg.cluster:
            return
        async with self._slots:
            self._round_trips += 1
            with suppress(*TRANSPORT_ERRORS, rx.RedisError):
                await self._client.nodes_manager.initialize()

    def _pipeline(self) -> Any:
        """A non-transactional pipeline (a cluster one groups its commands by node)."""
        return self._client.pipeline() if self.cfg.cluster else self._client.pipeline(transaction=False)

    async def _per_node(self, keys: Sequence[str], command: str, *args: Any) -> list[Any]:
        """``command key *args`` for every key: one pipeline per node, nodes concurrently.
        Each key's reply, an exception (error reply), or ``DOWN``."""
        out: list[Any] = [DOWN] * len(keys)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            groups[self._node(key)].append(i)

        async def run(node: str, idx: list[int]) -> None:
            if not self._allow(node):
                return
            pipe = self._pipeline()
            for i in idx:
                pipe.execute_command(command, keys[i], *args)
            try:
                replies = await self._call(node, pipe.execute, raise_on_error=False)
            except Down:
                return
            except rx.RedisError as err:
                replies = [err] * len(idx)
            for i, reply in zip(idx, replies):
                out[i] = reply

        await gather_all([run(node, idx) for node, idx in groups.items()])
        return out


async def gather_all(coros: list[Awaitable[None]]) -> None:
    """Run ``coros`` to completion; a cancelled caller still waits for all of them."""
    if len(coros) == 1:
        await coros[0]
        return
    async with asyncio.TaskGroup() as group:
        for coro in coros:
            group.create_task(coro)  # type: ignore[arg-type]


__all__ = ["CLUSTER", "DOWN", "Down", "NO_BREAKER", "RedisNodes", "gather_all"]
