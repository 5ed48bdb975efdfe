"""Authenticated objects: keyed MACs, per-tenant keys derived from a deployment secret.

An object's xxh3 checksum catches damage, not forgery: whoever can write its bytes can write
a valid one.  So every object the store core commits is also *sealed*: a keyed BLAKE3 MAC
(16 bytes) over its logical header fields and its uncompressed payload, with the id of the
key that made it, both in the header (``kvstore.codec``).  See docs/integrity.md.

* **Deployment secret.**  A 0600 JSON file (``kvstore keys create``) holding one or more
  32-byte secrets by key id, and which id is current.  Rotation adds an id (new seals use it,
  objects sealed with the old ones stay readable); retiring an id removes it (its objects
  are then refused: counted misses, removed).
* **Tenant keys.**  ``derive(secret, tenant)`` is BLAKE3's key derivation with a fixed
  context, so each tenant (``default`` when there are no tenants) has its own key per id, and
  one tenant's key never verifies another's object.  An engine needs only its tenant's keys:
  ``kvstore keys export --tenant T`` writes a tenant key file (same JSON, ``tenant`` set,
  derived keys only); the store process holds the deployment file and derives per tenant.
* **Where a key comes from.**  A file path (``keys_file``), else the ``KVSTORE_KEYS``
  environment variable holding the file's JSON (a warning: environments leak), else the
  default file ``default_keys_path()``, created 0600 on first use.  Never a command-line
  value.
* **What the MAC covers.**  Geometry, dtype, layout, chunk hash, tag, parent, generated
  tokens, the key id and the raw payload.  Not the namespace: the store process rewrites it
  to the tenant-scoped one (``codec.rekey``) and the chunk hash already commits to it (it
  is a sha256 over the namespace).  Not the codec, stored length or checksum: an lz4 copy
  keeps its MAC and is checked once decompressed.
* **Encryption at rest** (per tenant, off by default: ``Keyring.encrypt``).  ``encrypt``
  makes the copy of a sealed object that goes to SSD or Redis: AES-256-GCM under the
  tenant's *cipher key* for the object's key id (``Keyring.cipher_key``: BLAKE3 key
  derivation from that id's MAC key under its own context), a fresh random 96-bit nonce,
  the header's logical fields, key id and MAC as associated data (``codec.aead_fields``).
  ``decrypt_in_place`` turns it back into the sealed object, bit for bit; a wrong tag, or a
  key id the tenant does not hold, raises ``ForgedObjectError``.  A decrypted object needs no
  MAC check: the tag already proved the tenant's key made it, header and MAC included.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvstore import codec
from kvstore.errors import ConfigError, ObjectFormatError

log = logging.getLogger("kvstore.integrity")

MAC_SIZE = 16
KEY_SIZE = 32
DEPLOYMENT_FORMAT = "kvstore-deployment-keys/1"
TENANT_FORMAT = "kvstore-tenant-keys/1"
_CONTEXT = "kvstore 2026-12 object MAC tenant key v1"
_CIPHER_CONTEXT = "kvstore 2026-12 object AES-256-GCM tenant key v1"
ENV_KEYS = "KVSTORE_KEYS"
DEFAULT_TENANT = "default"
_DECRYPT_PIECE = 1 << 20  # decrypt_in_place works through a scratch buffer of this size
_BLOCK = 16  # AES block: update_into wants room for one more block less a byte


class ForgedObjectError(ObjectFormatError):
    """An object whose MAC does not verify under its tenant's keys (or names no key it has)."""


def derive(secret: bytes, tenant: str) -> bytes:
    """The 32-byte MAC key of ``tenant`` under one deployment secret."""
    material = len(tenant.encode()).to_bytes(2, "little") + tenant.encode() + secret
    return blake3.blake3(material, derive_key_context=_CONTEXT).digest()


@dataclass(frozen=True)
class Keyring:
    """One tenant's MAC keys by key id; ``current`` seals, every id present verifies."""

    tenant: str
    keys: Mapping[int, bytes]
    current: int
    encrypt: bool = False  # objects leaving host memory for SSD / Redis are encrypted
    _ciphers: dict[int, bytes] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.current not in self.keys:
            raise ConfigError(f"current key id {self.current} is not among the key ids {sorted(self.keys)}")
        for kid, key in self.keys.items():
            if not 0 < kid < 1 << 16 or len(key) != KEY_SIZE:
                raise ConfigError(f"key id {kid}: ids are 1-65535 and keys {KEY_SIZE} bytes")

    def __repr__(self) -> str:  # never the keys
        return (
            f"Keyring(tenant={self.tenant!r}, ids={sorted(self.keys)}, current={self.current}, encrypt={self.encrypt})"
        )

    def encrypting(self, on: bool) -> Keyring:
        """The same keys, with encryption at rest ``on`` or off."""
        return self if on == self.encrypt else Keyring(self.tenant, self.keys, self.current, on)

    def cipher_key(self, kid: int) -> bytes:
        """The 32-byte AES-256-GCM key of key id ``kid``: derived from that id's MAC key under
        its own context, so the two never coincide; ``ForgedObjectError`` for an id not held."""
        key = self._ciphers.get(kid)
        if key is None:
            mac_key = self.keys.get(kid)
            if mac_key is None:
                raise ForgedObjectError(f"encrypted with key id {kid}, which tenant {self.tenant!r} does not hold")
            key = self._ciphers[kid] = blake3.blake3(mac_key, derive_key_context=_CIPHER_CONTEXT).digest()
        return key

    def mac(self, kid: int, fields: bytes, payload) -> bytes:
        key = self.keys.get(kid)
        if key is None:
            raise ForgedObjectError(f"sealed with key id {kid}, which tenant {self.tenant!r} does not hold")
        h = blake3.blake3(fields, key=key)
        h.update(payload)
        return h.digest(MAC_SIZE)


@dataclass
class Deployment:
    """A deployment secret file's content: secrets by key id, the current id."""

    secrets: dict[int, bytes] = field(default_factory=dict)
    current: int = 0

    def keyring(self, tenant: str) -> Keyring:
        return Keyring(tenant, {kid: derive(s, tenant) for kid, s in self.secrets.items()}, self.current)

    def __repr__(self) -> str:
        return f"Deployment(ids={sorted(self.secrets)}, current={self.current})"


class KeySource:
    """What a keys file gave: a deployment (any tenant's keys) or one tenant's keys."""

    def __init__(self, deployment: Deployment | None = None, tenant: Keyring | None = None, origin: str = "") -> None:
        self.deployment, self.tenant, self.origin = deployment, tenant, origin
        self._rings: dict[str, Keyring] = {}

    def keyring(self, tenant: str | None = None) -> Keyring:
        """``tenant``'s keys (a tenant key file: its own tenant only, which ``None`` names)."""
        if self.tenant is not None:
            if tenant is not None and tenant != self.tenant.tenant:
                raise ConfigError(f"{self.origin}: holds the keys of tenant {self.tenant.tenant!r}, not {tenant!r}")
            return self.tenant
        assert self.deployment is not None
        tenant = DEFAULT_TENANT if tenant is None else tenant
        ring = self._rings.get(tenant)
        if ring is None:
            ring = self._rings[tenant] = self.deployment.keyring(tenant)
        return ring


# --- files ----------------------------------------------------------------------------------


def default_keys_path() -> Path:
    """``$KVSTORE_STATE_DIR/keys.json``, else ``$XDG_STATE_HOME/kvstore/keys.json``, else
    ``~/.local/state/kvstore/keys.json``."""
    state = os.environ.get("KVSTORE_STATE_DIR")
    if state:
        return Path(state) / "keys.json"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvstore" / "keys.json"


def _parse(text: str, origin: str) -> KeySource:
    try:
        doc = json.loads(text)
        fmt = doc["format"]
        keys = {int(k): bytes.fromhex(v) for k, v in doc["keys"].items()}
        current = int(doc["current"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{origin}: not a kvstore keys file ({type(err).__name__}: {err})") from None
    if any(len(v) != KEY_SIZE for v in keys.values()):
        raise ConfigError(f"{origin}: every key must be {KEY_SIZE} bytes")
    if fmt == DEPLOYMENT_FORMAT:
        if current not in keys:
            raise ConfigError(f"{origin}: current key id {current} is not in the file")
        return KeySource(deployment=Deployment(keys, current), origin=origin)
    if fmt == TENANT_FORMAT:
        return KeySource(tenant=Keyring(str(doc.get("tenant", "")), keys, current), origin=origin)
    raise ConfigError(f"{origin}: unknown keys format {fmt!r}")


def dump(source: Deployment | Keyring) -> str:
    if isinstance(source, Deployment):
        doc = {
            "format": DEPLOYMENT_FORMAT,
            "current": source.current,
            "keys": {str(k): v.hex() for k, v in sorted(source.secrets.items())},
        }
    else:
        doc = {
            "format": TENANT_FORMAT,
            "tenant": source.tenant,
            "current": source.current,
            "keys": {str(k): v.hex() for k, v in sorted(source.keys.items())},
        }
    return json.dumps(doc, indent=1) + "\n"


def write_private(path: Path, text: str, *, exclusive: bool = False) -> None:
    """Write ``text`` to ``path`` as a 0600 file (atomically: a temporary file renamed, or
    created with O_EXCL when ``exclusive``)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if exclusive:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_file(path: Path) -> KeySource:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"keys file {path}: {err.strerror}") from None
    if mode & 0o077:
        log.warning("kvstore: keys file %s is readable by group or others (chmod 600 it)", path)
    return _parse(text, f"keys file {path}")


def new_deployment() -> Deployment:
    return Deployment({1: secrets.token_bytes(KEY_SIZE)}, 1)


def load_keys(path: Path | str | None = None, env: Mapping[str, str] | None = None) -> KeySource:
    """The keys of a store or connector (module docstring: a file, ``KVSTORE_KEYS``, or the
    default file, made on first use)."""
    env = os.environ if env is None else env
    if path:
        return read_file(Path(path))
    if env.get(ENV_KEYS):
        log.warning("kvstore: MAC keys taken from the %s environment variable; a 0600 keys file leaks less", ENV_KEYS)
        return _parse(env[ENV_KEYS], ENV_KEYS)
    default = default_keys_path()
    if not default.exists():
        try:
            write_private(default, dump(new_deployment()), exclusive=True)
            log.info("kvstore: created the deployment secret %s (0600)", default)
        except FileExistsError:
            pass  # another process made it first: read theirs
        except OSError as err:
            raise ConfigError(
                f"cannot create the default keys file {default} ({err.strerror}); "
                f"give one with keys_file / --keys-file or set KVSTORE_STATE_DIR"
            ) from None
    return read_file(default)


# --- sealing ----------------------------------------------------------------------------------


def seal(buf, ring: Keyring) -> None:
    """Write ``ring``'s current key id and the MAC into the header of the whole,
    uncompressed object in ``buf`` (its header checksum is rewritten)."""
    codec.set_mac(buf, ring.current, ring.mac(ring.current, *codec.mac_input(buf, ring.current)))


def check(buf, ring: Keyring) -> int:
    """Verify the MAC of the whole, uncompressed object in ``buf`` under ``ring``; its key id.
    Raises ``ForgedObjectError`` (an unsealed object, an unknown or retired key id, a bad MAC)."""
    header = codec.decode_header(buf)
    if header.key_id == 0:
        raise ForgedObjectError(f"object {header.key!r} carries no MAC")
    want = ring.mac(header.key_id, *codec.mac_input(buf, header.key_id))
    if not hmac.compare_digest(want, header.mac):
        raise ForgedObjectError(f"MAC mismatch for {header.key!r} (key id {header.key_id})")
    return header.key_id


# --- encryption at rest ----------------------------------------------------------------------


def encrypt(obj, ring: Keyring, out: bytearray | None = None) -> memoryview:
    """The encrypted copy of the sealed object in ``obj`` (any codec: compress first), under
    the cipher key of its own key id (``codec`` module docstring for the layout).  ``obj``
    is only read.  The copy is written to the start of ``out`` when given (a reused buffer:
    a fresh 32 MiB one costs more than the encryption), else to a new buffer.  An unsealed
    or already encrypted object, or an ``out`` too small, raises ``ConfigError``."""
    view = memoryview(obj).cast("B")
    header = codec.decode_header(view)
    if header.key_id == 0 or header.encrypted:
        raise ConfigError(f"object {header.key!r}: only a sealed, unencrypted object is encrypted")
    n, at = header.stored_len, codec.HEADER_SIZE
    total = at + n + codec.AEAD_OVERHEAD
    if out is None:
        out = bytearray(total)
    elif len(out) < total:
        raise ConfigError(f"a {len(out)}-byte buffer cannot hold the {total}-byte encrypted object")
    dst = memoryview(out)[:total]
    nonce = secrets.token_bytes(codec.AEAD_NONCE)
    enc = Cipher(algorithms.AES(ring.cipher_key(header.key_id)), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(codec.aead_fields(view))
    enc.update_into(view[at : at + n], dst[at : at + n + codec.AEAD_TAG - 1])
    enc.finalize()
    dst[at + n : at + n + codec.AEAD_TAG] = enc.tag
    dst[at + n + codec.AEAD_TAG :] = nonce
    dst[:at] = codec.with_payload(header, True, n + codec.AEAD_OVERHEAD, xxhash.xxh3_128_digest(dst[at:]))
    return dst


def _decrypt_into_itself(dec, view: memoryview) -> None:
    """Run ``dec`` over ``view`` and leave the plaintext in ``view``, a piece at a time
    through a small scratch buffer: ``update_into`` refuses overlapping buffers (cryptography
    51 and later), and the plaintext of a piece never runs ahead of the ciphertext read."""
    scratch = bytearray(min(len(view), _DECRYPT_PIECE) + _BLOCK - 1)
    read = written = 0
    while read < len(view):
        piece = view[read : read + _DECRYPT_PIECE]
        out = dec.update_into(piece, scratch)
        view[written : written + out] = scratch[:out]
        read, written = read + len(piece), written + out
    if written != len(view):  # GCM is a stream mode: every byte in gives one out
        raise ForgedObjectError(f"AES-GCM gave {written} of {len(view)} bytes")


def decrypt_in_place(buf, ring: Keyring) -> codec.ObjectHeader:
    """Turn the encrypted object in ``buf`` back into the sealed one it was made from (its
    header says how long it now is).  ``ForgedObjectError`` when the tag does not verify
    under ``ring`` (another tenant's key, a retired key id, a changed byte or header, a
    ciphertext moved from another object); then ``buf`` holds garbage and must not be used."""
    view = memoryview(buf).cast("B")
    header = codec.decode_header(view)
    if not header.encrypted:
        raise ConfigError(f"object {header.key!r} is not encrypted")
    at, n = codec.HEADER_SIZE, header.plain_len
    if len(view) < header.total_len:
        raise ForgedObjectError(f"encrypted object {header.key!r} truncated")
    tail = bytes(view[at + n : header.total_len])
    dec = Cipher(
        algorithms.AES(ring.cipher_key(header.key_id)), modes.GCM(tail[codec.AEAD_TAG :], tail[: codec.AEAD_TAG])
    ).decryptor()
    dec.authenticate_additional_data(codec.aead_fields(view))
    _decrypt_into_itself(dec, view[at : at + n])
    try:
        dec.finalize()
    except InvalidTag:
        raise ForgedObjectError(f"AES-GCM tag mismatch for {header.key!r} (key id {header.key_id})") from None
    view[:at] = codec.with_payload(header, False, n, codec.checksum(view[at : at + n]))
    return codec.decode_header(view)


__all__ = [
    "DEFAULT_TENANT",
    "Deployment",
    "ForgedObjectError",
    "KeySource",
    "Keyring",
    "MAC_SIZE",
    "check",
    "decrypt_in_place",
    "default_keys_path",
    "derive",
    "encrypt",
    "dump",
    "load_keys",
    "new_deployment",
    "read_file",
    "seal",
    "write_private",
]
