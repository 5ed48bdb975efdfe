"""The default token's file (``kvstore.localtoken``) and the tenants' ``uid``/``gid`` keys."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.localtoken import default_token_path, ensure_token, local_token
from kvstore.server.auth import TokenTable


def test_the_path_follows_the_environment():
    assert default_token_path({"KVSTORE_TOKEN_PATH": "/x/t", "XDG_STATE_HOME": "/s"}) == Path("/x/t")
    assert default_token_path({"XDG_STATE_HOME": "/s", "HOME": "/h"}) == Path("/s/kvstore/token")
    assert default_token_path({"HOME": "/h"}) == Path("/h/.local/state/kvstore/token")


def test_one_token_is_made_once_even_by_servers_starting_together(tmp_path):
    path = tmp_path / "state" / "kvstore" / "token"
    assert local_token(path) is None
    with ThreadPoolExecutor(8) as pool:
        made = set(pool.map(lambda _: ensure_token(path), range(32)))
    assert len(made) == 1 and local_token(path) in made and len(made.pop()) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temp file left behind


def test_an_empty_token_file_is_refused_without_guessing(tmp_path):
    path = tmp_path / "token"
    path.write_text("\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="empty or malformed"):
        ensure_token(path)


@pytest.mark.parametrize("value", [-1, "1001", True, 2**32])
def test_a_tenant_uid_must_be_a_number(value):
    doc = {"tokens": [{"token": "t", "tenant": "a", "permissions": ["read"]}], "tenants": {"a": {"uid": value}}}
    with pytest.raises(ConfigError, match=r"tenants\.a\.uid: expected a numeric uid"):
        TokenTable.from_document(doc)


def test_a_tenant_uid_and_gid_are_kept():
    doc = {
        "tokens": [{"token": "t", "tenant": "a", "permissions": ["read"]}],
        "tenants": {"a": {"uid": 1001, "gid": 1002, "leases": 8}},
    }
    limits = TokenTable.from_document(doc).limits["a"]
    assert (limits.uid, limits.gid, limits.leases) == (1001, 1002, 8)
