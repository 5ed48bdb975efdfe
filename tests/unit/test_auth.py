"""Tokens files and bearer parsing: a table of broken files, each named in its error."""
from pathlib import Path

import pytest

from kvstore.server.auth import (ALL_PERMISSIONS, ANONYMOUS, Authenticator, Permission, PermissionDeniedError,
                          Principal, TokenTable, UnauthenticatedError, bearer_token)
from kvstore.errors import ConfigError

GOOD = """
tokens:
  - {token: tok-a, tenant: a, permissions: [read, write, shm]}
  - {token: tok-a-ro, tenant: a, permissions: [read]}
  - {token: tok-b, tenant: b, permissions: [read, write]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    return path


def test_load_maps_tokens_to_principals(tmp_path):
    table = TokenTable.load(write(tmp_path, GOOD))
    assert len(table) == 3
    assert table.tenants == {"a", "b"}
    assert table.principal("tok-a") == Principal("a", ALL_PERMISSIONS)
    assert table.principal("tok-a-ro") == Principal("a", frozenset({Permission.READ}))
    assert table.principal("tok-b").permission_names == ["read", "write"]
    assert table.principal("tok-c") is None


@pytest.mark.parametrize("text,needle", [
    ("tokens: [{token: x, tenant: a, permissions: [read]}, {token: x, tenant: b, permissions: [read]}]",
     "tokens[1] repeats the token of tokens[0]"),
    ("tokens: [{token: x, tenant: a, permissions: [read, admin]}]", "unknown permission 'admin'"),
    ("tokens: [{token: x, tenant: '', permissions: [read]}]", "'tenant' must be a non-empty string"),
    ("tokens: [{token: x, tenant: '  ', permissions: [read]}]", "'tenant' must be a non-empty string"),
    ("tokens: [{token: x, permissions: [read]}]", "'tenant' must be a non-empty string, got None"),
    ("tokens: [{token: '', tenant: a, permissions: [read]}]", "'token' must be a non-empty string"),
    ("tokens: [{token: 'a b', tenant: a, permissions: [read]}]", "must not contain spaces"),
    ("tokens: [{token: 7, tenant: a, permissions: [read]}]", "'token' must be a non-empty string"),
    ("tokens: [{token: x, tenant: a, permissions: []}]", "'permissions' must be a non-empty list"),
    ("tokens: [{token: x, tenant: a, permissions: read}]", "'permissions' must be a non-empty list"),
    ("tokens: [{token: x, tenant: a, permissions: [read], role: admin}]", "unknown key(s) role"),
    ("tokens: [x]", "tokens[0]: expected a mapping"),
    ("tokens: []", "'tokens' must be a non-empty list"),
    ("users: []", "expected a mapping with one key 'tokens'"),
    ("- a\n- b", "expected a mapping with one key 'tokens'"),
    ("tokens: [unclosed", "is not valid YAML"),
])
def test_bad_files_are_named(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        TokenTable.load(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_duplicate_error_does_not_echo_the_token(tmp_path):
    path = write(tmp_path, "tokens: [{token: s3cret, tenant: a, permissions: [read]},"
                           " {token: s3cret, tenant: a, permissions: [write]}]")
    with pytest.raises(ConfigError) as info:
        TokenTable.load(path)
    assert "s3cret" not in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        TokenTable.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        Authenticator.from_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize("metadata,expected", [
    ((("authorization", "Bearer abc"),), "abc"),
    ((("Authorization", "bearer   abc  "),), "abc"),
    ((("x-other", "1"), ("authorization", b"Bearer xyz")), "xyz"),
    ((("x-other", "1"),), None),
    ((), None),
    (None, None),
])
def test_bearer_token(metadata, expected):
    assert bearer_token(metadata) == expected


@pytest.mark.parametrize("value", ["Basic abc", "Bearer", "Bearer   ", "abc"])
def test_malformed_authorization_is_unauthenticated(value):
    with pytest.raises(UnauthenticatedError, match="Bearer <token>"):
        bearer_token((("authorization", value),))


def test_authenticator(tmp_path):
    auth = Authenticator.from_file(write(tmp_path, GOOD))
    assert auth.enabled
    assert auth.authenticate((("authorization", "Bearer tok-b"),)).tenant == "b"
    with pytest.raises(UnauthenticatedError, match="missing"):
        auth.authenticate(())
    with pytest.raises(UnauthenticatedError, match="unknown bearer token"):
        auth.authenticate((("authorization", "Bearer tok-z"),))


def test_open_authenticator_is_default_tenant_with_everything():
    auth = Authenticator.from_file(None)
    assert not auth.enabled
    assert auth.authenticate(()) is ANONYMOUS
    assert ANONYMOUS.tenant == "default" and ANONYMOUS.permissions == ALL_PERMISSIONS


def test_require_names_the_missing_permission():
    who = Principal("a", frozenset({Permission.READ}))
    who.require(Permission.READ)
    with pytest.raises(PermissionDeniedError, match="tenant 'a': token lacks permission write, shm"):
        who.require(Permission.WRITE, Permission.READ, Permission.SHM)
