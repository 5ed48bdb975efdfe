"""Which weights an engine runs, as the connector's namespaces see them, and the one schema
of ``kv_transfer_params``.  Scheduler side; no I/O.

An engine's weights change in place while it runs: reinforcement-learning loops push new
weights into rollout engines (``reload_weights`` through ``collective_rpc``), then reset the
caches (``reset_prefix_cache(reset_connector=True)``, ``sleep(level>=1)`` or
``pause_generation(clear_cache=True)``: each calls the connector's ``reset_cache``).  The
identity's file digest (``connector.identity``) no longer names those weights, so every
namespace also carries a *weights version* (``Identity.weights_version``):

* ``""``: the weights the engine loaded from its files, untouched (every namespace of an
  engine that was never reset, as before);
* ``files:V``: the same weights, labelled ``V`` by the first request that declared it;
* ``memory:V``: weights updated in memory, declared ``V`` after the last reset: engines that
  received the same weights and declare the same version share KV through the lower tiers;
* ``memory:unlabelled:<random>``: weights updated in memory that nobody named: shares with
  nothing stored before, by this engine or any other (the safe default).

Who declares.  vLLM's own ``weight_version`` (``finish_weight_update``,
``update_weight_version``) lives in the engine core, which no connector hook reaches, so a
version is declared per request in ``kv_transfer_params`` (``SamplingParams(extra_args=
{"kv_transfer_params": ...})``, or the OpenAI server's ``kv_transfer_params`` field)::

    {"kvstore": {"weights_version": "step-42"}}

The first version declared after the engine starts, or after a reset, names the weights
until the next reset; a request declaring another one is served without the connector
(recomputed, never loaded or saved), counted as ``weights_version_mismatch`` and told why in
its output's ``kv_transfer_params``.  A declaration is trusted as a ``cache_salt`` is: it is
the caller's word that these are the weights.

The schema (``PARAMS_SCHEMA``) lives under the ``kvstore`` key, so other connectors' keys
beside it (a ``MultiConnector``, disaggregated prefill) are left alone.  Unknown keys inside
it are ignored with a counted warning; a malformed value refuses the connector for that
request (served by recompute, counted, the error returned in its ``kv_transfer_params``),
never a crash.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "kvstore"
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+/@-]{0,127}$")
PARAMS_SCHEMA: dict[str, str] = {
    "weights_version": "the version of the weights the engine runs, as whoever pushed them named it: "
    "1-128 characters of [A-Za-z0-9._:+/@-], starting with a letter or digit",
    "session": "the session (a chat, an agent run) the request belongs to, named as weights_version is; "
    "the keys below need it (connector.sessions)",
    "continues": "false on the session's last request: its objects no other session holds leave host DRAM "
    "first (default true)",
    "pin": "true: keep the session's objects in host DRAM until a request of it says pin false or "
    "continues false (pins are bounded: half the pool, the oldest pins go first); false: unpin",
    "resume_in_s": "seconds until the session's next request (0 to 86400): its objects are brought back "
    "into host DRAM from the lower tiers shortly before",
}
RESUME_MAX_S = 86400.0


class ParamsError(ValueError):
    """A ``kv_transfer_params`` value that does not follow ``PARAMS_SCHEMA``."""


@dataclass(frozen=True, slots=True)
class SessionHint:
    """A request's word about its session (``PARAMS_SCHEMA``; ``connector.sessions``)."""

    session: str
    continues: bool = True
    pin: bool | None = None  # None: as before
    resume_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class TransferParams:
    """Our part of one request's ``kv_transfer_params``."""

    weights_version: str | None = None
    unknown: tuple[str, ...] = ()  # keys under "kvstore" this version does not know (ignored)
    session: SessionHint | None = None


def parse_params(raw: Any) -> TransferParams:
    """Our part of a request's ``kv_transfer_params`` (None or no ``kvstore`` key: nothing).
    Raises ``ParamsError`` naming the key on a malformed value."""
    if raw is None:
        return TransferParams()
    if not isinstance(raw, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
    ours = raw.get(PARAMS_KEY)
    if ours is None:
        return TransferParams()
    if not isinstance(ours, dict):
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} must be an object, got {type(ours).__name__}")
    version = ours.get("weights_version")
    if version is not None and (not isinstance(version, str) or not VERSION_RE.fullmatch(version)):
        raise ParamsError(
            f"kv_transfer_params.{PARAMS_KEY}.weights_version: {PARAMS_SCHEMA['weights_version']}; "
            f"got {str(version)[:40]!r}"
        )
    unknown = tuple(sorted(str(k) for k in ours if k not in PARAMS_SCHEMA))
    return TransferParams(version, unknown, _session(ours))


def _session(ours: dict) -> SessionHint | None:
    """The session keys of our part (``PARAMS_SCHEMA``); ``ParamsError`` naming a bad one."""
    name = ours.get("session")
    if name is None:
        extra = [k for k in ("continues", "pin", "resume_in_s") if k in ours]
        if extra:
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.{extra[0]} needs a session: {PARAMS_SCHEMA['session']}")
        return None
    if not isinstance(name, str) or not VERSION_RE.fullmatch(name):
        raise ParamsError(
            f"kv_transfer_params.{PARAMS_KEY}.session: {PARAMS_SCHEMA['session']}; got {str(name)[:40]!r}"
        )
    for flag in ("continues", "pin"):
        if flag in ours and not isinstance(ours[flag], bool):
            raise ParamsError(f"kv_transfer_params.{PARAMS_KEY}.{flag} must be true or false, got {ours[flag]!r:.40}")
    resume = ours.get("resume_in_s")
    if resume is not None and (
        isinstance(resume, bool) or not isinstance(resume, int | float) or not 0 <= resume <= RESUME_MAX_S
    ):
        raise ParamsError(
            f"kv_transfer_params.{PARAMS_KEY}.resume_in_s: {PARAMS_SCHEMA['resume_in_s']}; got {resume!r:.40}"
        )
    return SessionHint(name, ours.get("continues", True), ours.get("pin"), None if resume is None else float(resume))


class WeightsEpoch:
    """The engine's weights as its namespaces name them (``current``), changed by resets and
    by declarations (see the module docstring)."""

    def __init__(self) -> None:
        self.origin = "files"  # "files" until the first reset, then "memory"
        self.label: str | None = None  # the declared version, None until one is declared
        self.resets = 0
        self._nonce = ""
        self.current = ""

    def reset(self) -> None:
        """Weights may have changed in memory: a new epoch nobody shares until declared."""
        self.origin, self.label, self.resets = "memory", None, self.resets + 1
        self._nonce = uuid.uuid4().hex
        self.current = f"memory:unlabelled:{self._nonce}"

    def admit(self, version: str | None) -> bool:
        """Whether a request declaring ``version`` (None: none) may use the connector; the
        first version declared in an epoch becomes its label (and ``current`` changes)."""
        if version is None or version == self.label:
            return True
        if self.label is not None:
            return False
        self.label = version
        self.current = f"{self.origin}:{version}"
        return True


__all__ = ["PARAMS_KEY", "PARAMS_SCHEMA", "ParamsError", "TransferParams", "WeightsEpoch", "parse_params"]
