"""Settings: the one typed converter and loader behind every kvstore configuration, and the
field sets they share.  Foundation module (any side): it imports nothing of kvstore above it.

A configuration is a frozen dataclass; each field's type says how a raw value (a flag, a
``KVSTORE_*`` environment variable, a YAML or JSON value) becomes a typed one:

* ``Size`` (``Annotated[int, SIZE]``): bytes, or a string such as ``512MiB``, ``8GiB``, ``1.5GB``;
* ``Seconds`` (``Annotated[float, SECONDS]``) and ``float``: a finite number;
* ``int``; ``bool`` (``true``/``false``, ``yes``/``no``, ``on``/``off``, ``1``/``0``); ``str``; ``Path``;
* an ``Enum``: one of its values, never a free string;
* a class with ``parse(value, where)`` (the connector's ``DeviceSpec``);
* ``X | None``: ``None`` or ``""`` is ``None``, anything else an ``X``.

``load(cls, *sources)`` merges ``Source`` layers, highest first (``given`` mappings,
``from_env`` variables under a prefix, ``from_yaml`` files), converts each key with
``convert`` and builds ``cls``.  A bad value raises ``ConfigError`` naming the key and where it
came from (``--lease-ttl``, ``KVSTORE_SERVE_LEASE_TTL``, ``serve.yaml: lease_ttl``,
``kv_connector_extra_config: device``); a value the class's own checks refuse gets its origin
appended.  Each field is declared with ``setting(default, doc)``: the doc is the help of
``kvstore serve`` and the tables of ``docs/reference/`` (``python -m harness.docgen``).

Field sets: ``TierSettings`` (host pool, SSD tier, write policy: every store, declared
once for the embedded store's ``StoreConfig``, the connector and the store process) and
``LeaseSettings`` (``lease_ttl``: the store process and the connector, its client).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from kvstore.errors import ConfigError

T = TypeVar("T")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
SIZE, SECONDS = "size", "seconds"  # markers of the Annotated field types below
Size = Annotated[int, SIZE]
Seconds = Annotated[float, SECONDS]
MAX_SECONDS = 1e7  # TTLs and timeouts beyond ~4 months are mistakes (and overflow ms fields)


# --- converting one value ----------------------------------------------------------------------


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from an int or a string such as ``512MiB``, ``8GiB``, ``1.5GB`` or ``4096``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot parse size {value!r} (examples: 4096, 512MiB, 8GiB)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return n


def parse_bool(value: object, what: str = "flag") -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in _BOOLS:
        raise ConfigError(f"{what}: expected true or false, got {value!r}")
    return _BOOLS[text]


def _integer(value: object, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return int(value.strip(), 10)
    except ValueError as err:
        raise ConfigError(f"{where}: expected an integer, got {value!r}") from err


def _number(value: object, where: str, what: str = "a number") -> float:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(value)
        out = float(value)
    except ValueError as err:
        raise ConfigError(f"{where}: expected {what}, got {value!r}") from err
    if not math.isfinite(out):
        raise ConfigError(f"{where}: expected a finite {what.removeprefix('a ')}, got {value!r}")
    return out


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _path(value: object, where: str) -> Path:
    if not isinstance(value, (str, os.PathLike)) or value == "":
        raise ConfigError(f"{where}: expected a path, got {value!r}")
    return Path(value)


def _enum(tp: type[Enum], value: object, where: str) -> Enum:
    if isinstance(value, tp):
        return value
    try:
        return tp(value)
    except ValueError as err:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(str(m.value) for m in tp)}") from err


_CONVERTERS: dict[object, Callable[[object, str], object]] = {
    SIZE: parse_size,
    SECONDS: lambda v, w: _number(v, w, "a number of seconds"),
    int: _integer,
    float: _number,
    bool: parse_bool,
    str: _string,
    Path: _path,
}


def convert(tp: object, value: object, where: str) -> object:
    """``value`` as field type ``tp`` (see the module docstring); ``ConfigError`` naming ``where``."""
    if get_origin(tp) in (Union, UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        assert len(inner) == 1, f"only X | None is supported, not {tp}"
        return None if value is None or value == "" else convert(inner[0], value, where)
    key = get_args(tp)[1] if get_origin(tp) is Annotated else tp
    if key in _CONVERTERS:
        return _CONVERTERS[key](value, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum(tp, value, where)
    parse = getattr(tp, "parse", None)
    assert parse is not None, f"no conversion to {tp!r}"
    return parse(value, where)


def _field_types(cls: type) -> dict[str, object]:
    """Field name → its type (``Annotated`` markers kept) for dataclass ``cls``."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in fields(cls)}


# Cached per class.  Typed by hand: functools.cache's wrapper wants Hashable arguments, which
# mypy does not grant type[T].
field_types: Callable[[type], dict[str, object]] = cache(_field_types)


def setting(default: object, doc: str) -> Any:
    """A dataclass field with its documentation (``kvstore serve --help``, docs/reference/)."""
    return field(default=default, metadata={"doc": doc})


# --- sources, merged by precedence --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Source:
    """One layer of raw settings: values by field name, and how errors name each key."""

    values: Mapping[str, object]
    label: Callable[[str], str]


def given(
    cls: type, values: Mapping[str, object] | None, where: str, label: Callable[[str], str] | None = None
) -> Source:
    """A mapping of settings (extra config, flags, a file's contents): ``-`` in a key reads as
    ``_``; an unknown key raises ``ConfigError`` naming ``where`` and the known keys."""
    names = field_types(cls)
    out: dict[str, object] = {}
    unknown = []
    for key, value in (values or {}).items():
        name = str(key).replace("-", "_")
        if name in out:
            raise ConfigError(f"{where}: {key!r} repeats the setting {name!r}")
        out[name] = value
        if name not in names:
            unknown.append(repr(str(key)))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"known: {', '.join(sorted(names))}"
        )
    return Source(out, label or (lambda key: f"{where}: {key}"))


def from_env(cls: type, env: Mapping[str, str] | None, prefix: str) -> Source:
    """``<prefix><KEY>`` variables of ``env`` (``os.environ`` when None) for the fields of ``cls``."""
    env = os.environ if env is None else env
    values = {name: env[prefix + name.upper()] for name in field_types(cls) if prefix + name.upper() in env}
    return Source(values, lambda key: prefix + key.upper())


def from_yaml(cls: type, path: str | Path) -> Source:
    """The settings in a YAML mapping (``host_capacity: 8GiB`` or ``host-capacity: 8GiB``)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as err:
        raise ConfigError(f"config file {path} does not exist") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} is not readable: {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(doc).__name__}")
    return given(cls, doc, f"config file {path}", lambda key: f"{path}: {key}")


def load(cls: type[T], *sources: Source) -> T:
    """``cls`` from ``sources``, highest precedence first; defaults fill the rest."""
    types = field_types(cls)
    chosen: dict[str, tuple[object, str]] = {}
    for source in reversed(sources):
        chosen.update((key, (value, source.label(key))) for key, value in source.values.items())
    values = {key: convert(types[key], value, where) for key, (value, where) in chosen.items()}
    try:
        return cls(**values)
    except ConfigError as err:
        found = ((re.search(rf"\b{key}\b", str(err)), where) for key, (_, where) in chosen.items())
        origins = [where for _, where in sorted((m.start(), where) for m, where in found if m)]
        if not origins:
            raise
        raise type(err)(f"{err} (from {', '.join(origins)})") from err  # in the order the message names them


# --- secrets ------------------------------------------------------------------------------------


def read_token_file(path: str | os.PathLike) -> str:
    """The bearer token in ``path``: its first line, stripped; ``ConfigError`` (naming the
    file, never its content) when it is unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"token file {path} is not readable: {getattr(err, 'strerror', None) or err}") from err
    if not token:
        raise ConfigError(f"token file {path} is empty")
    if os.stat(path).st_mode & 0o077:
        logging.getLogger("kvstore").warning(
            "token file %s can be read by other users (mode %o): make it 0600", path, os.stat(path).st_mode & 0o777
        )
    return token


def redact_url(url: str) -> str:
    """``url`` with its password (``scheme://user:PASSWORD@host``) replaced by ``***``."""
    head, sep, rest = url.partition("://")
    netloc = rest.split("/", 1)[0]
    if not sep or "@" not in netloc:
        return url
    auth, _, tail = rest.partition("@")
    user, colon, _ = auth.partition(":")
    return f"{head}://{user}{':***' if colon else ''}@{tail}"


# --- the shared field sets ----------------------------------------------------------------------


class WritePolicy(Enum):
    """How objects published in host DRAM reach the lower tiers (one vocabulary for the
    embedded store, the store process and the connector)."""

    WRITE_THROUGH = "write_through"  # each committed object is copied to every lower tier
    WRITE_BACK = "write_back"  # kept in host DRAM (never evicted unwritten), written later
    HOST_ONLY = "host_only"  # lower tiers are read (and promoted from), never written


class RetentionPolicy(Enum):
    """Which objects the host DRAM pool evicts first when a put needs room (``tiers.retention``)."""

    REUSE = "reuse"  # objects used once before reused ones, least recently used first in each
    ADAPTIVE = "adaptive"  # the same two classes, each's share adapted to its evicted keys' returns (ARC)
    LRU = "lru"  # least recently used first


def check_seconds(name: str, value: float) -> None:
    if not 0 < value < MAX_SECONDS:
        raise ConfigError(f"{name} must be a positive number of seconds below {MAX_SECONDS:.0f}, got {value}")


def check_types(cfg: object) -> None:
    """Enum and parsed fields hold their type (a constructor given a free string fails here)."""
    for name, tp in field_types(type(cfg)).items():
        if isinstance(tp, type) and (issubclass(tp, Enum) or hasattr(tp, "parse")):
            if not isinstance(getattr(cfg, name), tp):
                raise ConfigError(f"{name}: expected a {tp.__name__}, got {getattr(cfg, name)!r}")


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What every store has: a host DRAM pool, an optional SSD tier, a write policy."""

    host_capacity: Size = setting(1 << 30, "size of the host DRAM pool, in bytes or a string such as `512MiB`")
    ssd_dir: Path | None = setting(None, "directory of the SSD tier (none: no SSD tier)")
    ssd_capacity: Size = setting(16 << 30, "size limit of the SSD tier")
    write_policy: WritePolicy = setting(
        WritePolicy.WRITE_THROUGH,
        (
            "how objects in host DRAM reach the lower tiers: `write_through` (each as it is committed), "
            "`write_back` (kept in host DRAM, unwritten ones never evicted; the oldest go down once they "
            "exceed half the pool, and all at shutdown; not in the store process) or `host_only` "
            "(lower tiers are only read)"
        ),
    )
    host_retention: RetentionPolicy = setting(
        RetentionPolicy.REUSE,
        (
            "which objects the host DRAM pool evicts first when a put needs room (chain tails always before their "
            "parents; leased, read or written objects never): `reuse` (objects used once before reused ones, least "
            "recently used first in each), `adaptive` (the same two classes, the share of each adapted online to "
            "how often the keys it evicted come back, as in ARC) or `lru` (least recently used first); "
            "see docs/bench-trace.md"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("host_capacity", "ssd_capacity"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class LeaseSettings:
    """``lease_ttl``, shared by the store process (its default grant) and its clients (what
    they ask for on each read).  No slots of its own (``__slots__ = ()``), so it combines
    with a slotted ``TierSettings`` subclass; the subclass's dataclass adds the slot."""

    __slots__ = ()
    lease_ttl: Seconds = setting(
        30.0,
        "seconds a lease pins an object read from the store process (the "
        "store's grant when a client asks for none; what the connector asks for, "
        "capped at the store's `max_lease_ttl`)",
    )

    def __post_init__(self) -> None:
        check_seconds("lease_ttl", self.lease_ttl)


@dataclass(frozen=True, slots=True)
class StoreConfig(TierSettings):
    """The embedded store (``kvstore.store.tiered.TieredStore.from_config``): the tier settings."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], env: Mapping[str, str] | None = None) -> StoreConfig:
        """Build from a mapping; ``KVSTORE_<KEY>`` environment variables fill missing keys."""
        return load(cls, given(cls, values, "config"), from_env(cls, env, "KVSTORE_"))

    def with_(self, **changes: Any) -> StoreConfig:
        return replace(self, **changes)
