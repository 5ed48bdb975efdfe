"""Keys at the store process's edge: a client's (namespace, chunk hash, tag) checked and bound
to the caller's tenant.  Server side, event loop only (the memos are not locked).

One implementation for both ways in: the gRPC servicer and the raw TCP data channel.  The
client's (namespace N, hash H, tag T) is stored as ``ObjectKey(N.scoped(tenant), H, T)``, so
no client can address another tenant's objects.  Bad parts raise ``ConfigError`` naming the
field (INVALID_ARGUMENT on either channel).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from kvstore.errors import ConfigError
from kvstore.keys import DIGEST_SIZE, ROOT, ChunkHash, Namespace, ObjectKey
from kvstore.server.auth import Principal
from kvstore.store.lookup import trusted_key

MAX_TAG_BYTES = 32
_NO_NAMESPACE = Namespace(bytes(DIGEST_SIZE))
_MEMO = 4096  # entries of each memo (scoped namespaces, valid tags)


def scoped_keys(scoped: Namespace, hashes: Sequence[bytes], tag: str) -> list[bytes]:
    """The canonical bytes of ``ObjectKey(scoped, ChunkHash(h), tag)`` for each hash: the
    namespace and tag are validated once by the caller and the hashes' lengths here (through
    the keys' lengths), which is all ``ObjectKey`` checks.  Plain ``bytes``, not
    ``ObjectKey``s: the host index finds an object by its key's bytes, and
    ``ServerStore.lookup`` makes ``ObjectKey``s (trusted constructor) only for keys it must
    ask a lower tier about.  512 keys take ~0.04 ms here, ~0.45 ms through ``ObjectKey``."""
    prefix, suffix = bytes(scoped), tag.encode()
    keys = list(map(b"".join, zip(repeat(prefix), hashes, repeat(suffix))))
    if set(map(len, keys)) - {len(prefix) + DIGEST_SIZE + len(suffix)}:
        i, h = next((i, h) for i, h in enumerate(hashes) if len(h) != DIGEST_SIZE)
        raise ConfigError(f"chunk_hashes[{i}] must be {DIGEST_SIZE} bytes, got {len(h)}")
    return keys


class Scoper:
    """Validation and tenant scoping of request keys, with small memos (see the module
    docstring)."""

    def __init__(self) -> None:
        self._scoped: dict[tuple[str, bytes], Namespace] = {}  # (tenant, namespace) -> scoped
        self._tags: set[str] = set()  # tags known to be valid

    def namespace(self, who: Principal, raw: bytes) -> Namespace:
        """The tenant-scoped namespace (a sha256: remembered for the last few thousand)."""
        scoped = self._scoped.get((who.tenant, raw))
        if scoped is None:
            if len(raw) != DIGEST_SIZE:
                raise ConfigError(f"namespace must be {DIGEST_SIZE} bytes, got {len(raw)}")
            if len(self._scoped) >= _MEMO:
                self._scoped.clear()
            scoped = self._scoped[(who.tenant, raw)] = Namespace(raw).scoped(who.tenant)
        return scoped

    @staticmethod
    def chunk_hash(raw: bytes, what: str = "chunk_hash") -> ChunkHash:
        if len(raw) != DIGEST_SIZE:
            raise ConfigError(f"{what} must be {DIGEST_SIZE} bytes, got {len(raw)}")
        return ChunkHash(raw)

    def tag(self, tag: str) -> str:
        """A valid object tag (``ObjectKey``'s rule; the last few thousand valid ones are
        remembered, so a request usually skips the regex)."""
        if tag not in self._tags:
            if not 0 < len(tag.encode("utf-8", "surrogatepass")) <= MAX_TAG_BYTES:
                raise ConfigError(f"tag must be 1-{MAX_TAG_BYTES} UTF-8 bytes, got {tag[:40]!r}")
            ObjectKey(_NO_NAMESPACE, ROOT, tag)  # ConfigError naming the tag when it is not valid
            if len(self._tags) >= _MEMO:
                self._tags.clear()
            self._tags.add(tag)
        return tag

    def keys(self, who: Principal, namespace: bytes, chunk_hash: bytes, tag: str) -> tuple[ObjectKey, ObjectKey]:
        """(client key, tenant-scoped key) of one request: each part validated, then the
        keys built by the trusted constructor."""
        h, suffix = self.chunk_hash(chunk_hash), self.tag(tag).encode()
        scoped = self.namespace(who, namespace)
        return trusted_key(namespace + h + suffix), trusted_key(scoped + h + suffix)

    def keys_of(self, who: Principal, raw: bytes) -> tuple[ObjectKey, ObjectKey]:
        """``keys`` of a client's whole ``ObjectKey`` bytes (the data channel's form)."""
        try:
            tag = raw[2 * DIGEST_SIZE :].decode("ascii")
        except UnicodeDecodeError as err:
            raise ConfigError("tag must be printable ASCII") from err
        return self.keys(who, raw[:DIGEST_SIZE], raw[DIGEST_SIZE : 2 * DIGEST_SIZE], tag)

    def parent_of(self, key: ObjectKey, raw: bytes) -> ObjectKey | None:
        """The scoped parent key of a put whose request named ``raw`` (b"": none)."""
        if not raw:
            return None
        ph = self.chunk_hash(raw, "parent_hash")
        return None if ph == ROOT else ObjectKey(key.namespace, ph, key.tag)


__all__ = ["MAX_TAG_BYTES", "Scoper", "scoped_keys"]
