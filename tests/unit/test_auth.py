"""Tokens files and bearer parsing: a table of broken files, each named in its error."""

from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.server.auth import (
    ALL_PERMISSIONS,
    ANONYMOUS,
    Authenticator,
    Permission,
    PermissionDeniedError,
    Principal,
    TokenTable,
    UnauthenticatedError,
    bearer_token,
)

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
    assert table.principal("tok-a") == Principal("a", ALL_PERMISSIONS - {Permission.ADMIN})
    assert table.principal("tok-a-ro") == Principal("a", frozenset({Permission.READ}))
    assert table.principal("tok-b").permission_names == ["read", "write"]
    assert table.principal("tok-c") is None


@pytest.mark.parametrize(
    "text,needle",
    [
        (
            "tokens: [{token: x, tenant: a, permissions: [read]}, {token: x, tenant: b, permissions: [read]}]",
            "tokens[1] repeats the token of tokens[0]",
        ),
        ("tokens: [{token: x, tenant: a, permissions: [read, root]}]", "unknown permission 'root'"),
        ("tokens: [{token: x, tenant: '', permissions: [read]}]", "'tenant' must be a non-empty string"),
        ("tokens: [{token: x, tenant: '  ', permissions: [read]}]", "'tenant' must be a non-empty string"),
        ("tokens: [{token: x, permissions: [read]}]", "'tenant' must be a non-empty string, got None"),
        ("tokens: [{token: '', tenant: a, permissions: [read]}]", "'token' must be a non-empty string"),
        ("tokens: [{tenant: a, permissions: [read]}]", "give the token exactly one way"),
        ("tokens: [{token: x, sha256: ab, tenant: a, permissions: [read]}]", "got token, sha256"),
        ("tokens: [{sha256: abcd, tenant: a, permissions: [read]}]", "'sha256' must be 64 hex digits"),
        ("tokens: [{token_env: NO_SUCH_VAR_X, tenant: a, permissions: [read]}]", "NO_SUCH_VAR_X (token_env) is unset"),
        ("tokens: [{token_file: /no/such/file, tenant: a, permissions: [read]}]", "token file /no/such/file"),
        ("tokens: [{token: x, tenant: a, permissions: [read]}]\ntenants: {b: {leases: 3}}", "tenants.b: no token"),
        (
            "tokens: [{token: x, tenant: a, permissions: [read]}]\ntenants: {a: {leases: 0}}",
            "tenants.a.leases: expected",
        ),
        (
            "tokens: [{token: x, tenant: a, permissions: [read]}]\ntenants: {a: {disk: 3}}",
            "tenants.a: expected a mapping",
        ),
        ("tokens: [{token: 'a b', tenant: a, permissions: [read]}]", "must not contain spaces"),
        ("tokens: [{token: 7, tenant: a, permissions: [read]}]", "'token' must be a non-empty string"),
        ("tokens: [{token: x, tenant: a, permissions: []}]", "'permissions' must be a non-empty list"),
        ("tokens: [{token: x, tenant: a, permissions: read}]", "'permissions' must be a non-empty list"),
        ("tokens: [{token: x, tenant: a, permissions: [read], role: admin}]", "unknown key(s) role"),
        ("tokens: [x]", "tokens[0]: expected a mapping"),
        ("tokens: []", "'tokens' must be a non-empty list"),
        ("users: []", "expected a mapping with 'tokens'"),
        ("- a\n- b", "expected a mapping with 'tokens'"),
        ("tokens: [unclosed", "is not valid YAML"),
    ],
)
def test_bad_files_are_named(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        TokenTable.load(path)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_duplicate_error_does_not_echo_the_token(tmp_path):
    path = write(
        tmp_path,
        "tokens: [{token: s3cret, tenant: a, permissions: [read]}, {token: s3cret, tenant: a, permissions: [write]}]",
    )
    with pytest.raises(ConfigError) as info:
        TokenTable.load(path)
    assert "s3cret" not in str(info.value)


def test_tokens_from_files_the_environment_or_digests_and_quotas(tmp_path, monkeypatch):
    import hashlib

    (tmp_path / "b.token").write_text("tok-from-file\n")
    monkeypatch.setenv("KV_TEST_TOKEN", "tok-from-env")
    digest = hashlib.sha256(b"tok-from-digest").hexdigest()
    table = TokenTable.load(
        write(
            tmp_path,
            f"""
tokens:
  - {{token_file: {tmp_path / "b.token"}, tenant: b, permissions: [read]}}
  - {{token_env: KV_TEST_TOKEN, tenant: c, permissions: [read, admin]}}
  - {{sha256: "{digest}", tenant: d, permissions: [write]}}
tenants:
  b: {{host_bytes: 64MiB, leases: 7}}
""",
        )
    )
    assert table.principal("tok-from-file").tenant == "b"
    assert table.principal("tok-from-env") == Principal("c", frozenset({Permission.READ, Permission.ADMIN}))
    assert table.principal("tok-from-digest").tenant == "d"
    assert table.limits["b"].host_bytes == 64 << 20 and table.limits["b"].leases == 7
    assert "tok-" not in repr(table)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        TokenTable.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        Authenticator.from_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "metadata,expected",
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("Authorization", "bearer   abc  "),), "abc"),
        ((("x-other", "1"), ("authorization", b"Bearer xyz")), "xyz"),
        ((("x-other", "1"),), None),
        ((), None),
        (None, None),
    ],
)
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


SECRET = "s3cret-never-shown-9f2c"


@pytest.mark.parametrize(
    "text",
    [
        f'tokens:\n  - {{token: "{SECRET}", tenant: a, permissions: [read]\n',  # unclosed flow mapping
        f"tokens:\n  - token: {SECRET}\n   tenant: a\n",  # bad indentation
        f'tokens:\n  - {{token: "{SECRET}\t\x07", tenant: a}}\n',  # control character
        f"tokens: [{{token: {SECRET}, tenant: a, permissions: [read]}}]\n  x: : y\n",  # stray mapping
    ],
)
def test_a_yaml_error_never_shows_a_token(tmp_path, caplog, text):
    with pytest.raises(ConfigError) as err:
        TokenTable.load(write(tmp_path, text))
    assert "is not valid YAML" in str(err.value)
    shown = str(err.value) + repr(err.value) + "".join(map(str, [err.value.__cause__, err.value.__context__]))
    assert SECRET not in shown and SECRET not in caplog.text


def test_an_inline_token_gets_a_warning_that_says_how_to_convert_it(tmp_path, caplog):
    table = TokenTable.load(write(tmp_path, f"tokens:\n  - {{token: {SECRET}, tenant: a, permissions: [read]}}\n"))
    assert table.principal(SECRET).tenant == "a"
    assert "an inline token" in caplog.text and "sha256:" in caplog.text and "kvstore tokens" in caplog.text
    assert SECRET not in caplog.text
    caplog.clear()
    TokenTable.load(write(tmp_path, "tokens:\n  - {sha256: " + "ab" * 32 + ", tenant: a, permissions: [read]}\n"))
    assert "inline token" not in caplog.text
