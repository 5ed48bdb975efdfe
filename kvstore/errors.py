"""All domain errors of kvstore, in one hierarchy.

Layers (docs/architecture.md#errors):
  * a broken invariant is an ``assert`` or ``RuntimeError`` and is not listed here;
  * an expected shortfall (a miss, no room in a tier) is a return value, not an error;
  * everything below is a domain error a caller may catch and act on.  Lower-level
    exceptions are translated with ``raise ... from err``.

``KVStoreError``
    ``ConfigError``            bad configuration or argument (also a ``ValueError``)
    ``ObjectFormatError``      a stored object's bytes cannot be trusted
        ``CorruptHeaderError``     magic/version/header checksum/geometry is wrong
        ``ChecksumMismatchError``  the payload does not match the header's checksum
        ``KeyMismatchError``       the object is intact but belongs to another key
    ``CapacityError``          an object can never fit (larger than the tier), not "full now"
    ``LifecycleError``         a transfer ticket was driven through an illegal transition
    ``LeaseError``             a lease is unknown or expired where a valid one is required
    ``TierError``              a tier failed to do I/O (disk error, unreachable backend)
        ``TierUnavailableError``   the tier is down / its circuit breaker is open
    ``UnauthenticatedError``   a store call carries no token or an unknown one
    ``PermissionDeniedError``  the caller's token lacks the permission a call needs
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every kvstore domain error."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value or argument is invalid; the message says which and why."""


class ObjectFormatError(KVStoreError):
    """The bytes of a stored object cannot be trusted; the object must be treated as a miss."""


class CorruptHeaderError(ObjectFormatError):
    """Magic, version, header checksum, lengths or geometry of an object header are wrong."""


class ChecksumMismatchError(ObjectFormatError):
    """The payload's checksum does not match the one recorded in the header."""


class KeyMismatchError(ObjectFormatError):
    """The object is intact but its header names a different key than the one asked for."""


class CapacityError(KVStoreError):
    """An object is larger than a tier can ever hold (not a transient 'tier is full')."""


class LifecycleError(KVStoreError):
    """A transfer was driven through a transition that the lifecycle table forbids."""


class LeaseError(KVStoreError):
    """A lease is unknown, released or expired where a valid one is required."""


class TierError(KVStoreError):
    """A tier failed to perform I/O."""


class TierUnavailableError(TierError):
    """A tier is down, or its circuit breaker is open."""


class UnauthenticatedError(KVStoreError):
    """The call carries no token, a malformed one, or one the server does not know."""


class PermissionDeniedError(KVStoreError):
    """The authenticated token lacks the permission a call needs."""
