"""Which requests the scheduler half serves, and under which namespace: a request's
``kv_transfer_params`` (``connector.epoch``) are read here, a refusal is counted, logged once
and told in the request's output, and each (cache_salt, LoRA) scope's namespace under the
weights in memory now is kept (least recently used dropped first).  Scheduler side; no I/O."""

from __future__ import annotations

import logging
from collections import OrderedDict

from connector.counters import SchedulerCounters
from connector.epoch import PARAMS_KEY, PARAMS_SCHEMA, ParamsError, WeightsEpoch, parse_params
from connector.requests import RequestView, identity_fields
from kvstore.keys import Identity, Namespace

log = logging.getLogger("kvstore.connector")
NAMESPACE_CACHE = 4096  # (cache_salt, LoRA) namespaces kept, least recently used dropped first:
# a salt per user must not grow the scheduler without bound


class Admission:
    def __init__(self, identity: Identity, counters: SchedulerCounters) -> None:
        self.identity, self.counters = identity, counters
        self.epoch = WeightsEpoch()  # which weights the namespaces name (resets, declared versions)
        self.namespaces: OrderedDict[tuple[str, str, str], Namespace] = OrderedDict()  # LRU, NAMESPACE_CACHE
        self._refused: OrderedDict[str, str] = OrderedDict()  # req id -> why the connector refused it
        self._warned: set[str] = set()  # refusal and unknown-key warnings already logged once

    def namespace(self, salt: str, lora: str) -> Namespace:
        """The namespace of one (cache_salt, LoRA) scope under the weights in memory now
        (``self.epoch``); a dropped entry is only recomputed."""
        key = (salt, lora, self.epoch.current)
        ns = self.namespaces.get(key)
        if ns is not None:
            self.namespaces.move_to_end(key)
            return ns
        ns = self.namespaces[key] = Identity(
            **{**identity_fields(self.identity), "scope": salt, "adapter": lora, "weights_version": self.epoch.current}
        ).namespace()
        if len(self.namespaces) > NAMESPACE_CACHE:
            self.namespaces.popitem(last=False)
        return ns

    def reset(self) -> None:
        """The weights in memory may have changed: a new epoch, no namespace made before."""
        self.epoch.reset()
        self.namespaces.clear()

    def admit(self, view: RequestView) -> bool:
        """Whether the connector serves this request, after reading its ``kv_transfer_params``
        (``connector.epoch``): a malformed value, or a weights version other than the one
        this engine's weights were declared as since the last reset, is served by recompute,
        counted and told in the request's output."""
        try:
            params = parse_params(view.params)
        except ParamsError as err:
            self._refuse(view.req_id, "bad_kv_transfer_params", str(err))
            return False
        if params.unknown:
            self.counters.unknown_params(params.unknown)
            self._warn_once(
                f"unknown:{params.unknown}",
                "kv_transfer_params.%s: unknown keys %s ignored (known: %s); counted in kvstore_params_unknown_keys",
                PARAMS_KEY,
                list(params.unknown),
                ", ".join(PARAMS_SCHEMA),
            )
        before = self.epoch.label
        if not self.epoch.admit(params.weights_version):
            self._refuse(
                view.req_id,
                "weights_version_mismatch",
                f"this engine's weights are version {self.epoch.label!r} since its last reset; the request "
                f"declares {params.weights_version!r}: served without the connector",
            )
            return False
        if self.epoch.label != before:
            log.info(
                "KVStoreConnector: the weights in memory are version %r (%s)", self.epoch.label, self.epoch.current
            )
        return True

    def _refuse(self, req_id: str, reason: str, message: str) -> None:
        self._refused[req_id] = message
        if len(self._refused) > NAMESPACE_CACHE:
            self._refused.popitem(last=False)
        self.counters.not_cached(req_id, reason)
        self._warn_once(reason, "KVStoreConnector: request %s: %s", req_id, message)

    def _warn_once(self, what: str, *args: object) -> None:
        if what not in self._warned and len(self._warned) < NAMESPACE_CACHE:
            self._warned.add(what)
            log.warning(*args)

    def refused(self, req_id: str) -> bool:
        """Whether ``req_id`` was refused and its output has not carried why yet."""
        return req_id in self._refused

    def output_params(self, req_id: str) -> dict[str, object] | None:
        """What the request's output carries in ``kv_transfer_params`` (why the connector
        refused it), once."""
        error = self._refused.pop(req_id, None)
        return None if error is None else {PARAMS_KEY: {"error": error}}


__all__ = ["NAMESPACE_CACHE", "Admission"]
