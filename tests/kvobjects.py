"""Sealed test objects and prefix keys for the tier and store tests, test side: a re-export of
``tests.kits.chain`` (where ``Chain``, the namespace-bound chain of keys, lives) for the many
modules that import them from here."""
from __future__ import annotations

from tests.kits.chain import keys_of, make_object, namespace, sealed

__all__ = ["keys_of", "make_object", "namespace", "sealed"]
