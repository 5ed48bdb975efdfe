"""Tenants' quotas alone (``kvstore.server.tenants``): how capacities are shared, the
``tenants`` section of a tokens file, and taking, giving back and refusing."""

import pytest

from kvstore.errors import CapacityError, ConfigError
from kvstore.keys import Namespace
from kvstore.server.tenants import Limits, Tenants, parse_limits

MiB = 1 << 20


@pytest.mark.parametrize(
    "limits,host,expected",
    [
        ({}, 64 * MiB, {"a": 32 * MiB, "b": 32 * MiB}),  # equal shares
        ({"a": Limits(host_bytes=48 * MiB)}, 64 * MiB, {"a": 48 * MiB, "b": 16 * MiB}),  # b gets the rest
        ({"a": Limits(host_bytes=8 * MiB), "b": Limits(host_bytes=8 * MiB)}, 64 * MiB, {"a": 8 * MiB, "b": 8 * MiB}),
        ({}, 3 * MiB + 100, {"a": 3 * MiB // 2 // 4096 * 4096, "b": 3 * MiB // 2 // 4096 * 4096}),  # whole pages
    ],
)
def test_host_shares(limits, host, expected):
    assert Tenants.plan(["b", "a"], limits, host, None).host_bytes == expected


@pytest.mark.parametrize(
    "limits,host,needle",
    [
        ({"a": Limits(host_bytes=65 * MiB)}, 64 * MiB, "leave 0 bytes"),
        ({"a": Limits(host_bytes=63 * MiB + 512 * 1024)}, 64 * MiB, "each needs at least"),
    ],
)
def test_shares_that_cannot_be_made_are_config_errors(limits, host, needle):
    with pytest.raises(ConfigError, match=needle):
        Tenants.plan(["a", "b"], limits, host, None)


def test_ssd_shares_only_with_an_ssd_tier():
    assert Tenants.plan(["a"], {}, 8 * MiB, None).ssd_bytes == {}
    assert Tenants.plan(["a", "b"], {"b": Limits(ssd_bytes=MiB * 3)}, 8 * MiB, 11 * MiB).ssd_bytes == {
        "a": 8 * MiB,
        "b": 3 * MiB,
    }


def test_take_give_refuse_and_marks():
    t = Tenants.plan(["a", "b"], {"a": Limits(leases=2)}, 8 * MiB, None)
    t.take("a", "leases")
    t.take("a", "leases")
    with pytest.raises(CapacityError, match="tenant 'a' holds 2 leases, its quota"):
        t.take("a", "leases")
    t.take("b", "leases")  # b's quota is its own
    t.give("a", "leases")
    t.take("a", "leases")
    with pytest.raises(RuntimeError):
        t.give("b", "streams")  # never taken
    t.refuse("b", "host_room")
    assert t.doc("a")["refused"] == {"leases": 1} and t.doc("b")["refused"] == {"host_room": 1}
    assert t.doc("a")["held"]["leases"] == 2 and t.doc("a")["quota"]["host_bytes"] == 4 * MiB
    ns = Namespace(bytes(32))
    assert t.tenant_of(ns.scoped("a")) == "a" and t.tenant_of(ns.scoped("zz")) is None and t.tenant_of(ns) is None


@pytest.mark.parametrize(
    "doc,needle",
    [
        ({"x": {"leases": 1}}, "tenants.x: no token names this tenant"),
        ({"a": {"leases": -1}}, "tenants.a.leases: expected a positive integer"),
        ({"a": {"leases": True}}, "tenants.a.leases: expected a positive integer"),
        ({"a": {"host_bytes": "lots"}}, "tenants.a.host_bytes: cannot parse size"),
        ({"a": {"bytes": 1}}, "tenants.a: expected a mapping of host_bytes"),
        (["a"], "'tenants' must be a mapping"),
    ],
)
def test_bad_tenants_sections_name_the_key(doc, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        parse_limits(doc, "tokens.yaml", {"a"})


def test_a_tenants_section_parses_sizes_and_counts():
    limits = parse_limits({"a": {"host_bytes": "16MiB", "streams": 3}}, "tokens.yaml", {"a"})
    assert limits == {"a": Limits(host_bytes=16 * MiB, streams=3)}


def test_the_new_quotas_parse_from_a_tenants_section():
    limits = parse_limits({"a": {"tickets": 8, "described_bytes": "1MiB", "described": 100}}, "tokens.yaml", {"a"})
    assert limits == {"a": Limits(tickets=8, described_bytes=MiB, described=100)}
    assert limits["a"].descriptions == (MiB, 100)
    assert Limits().tickets == 64 and Limits().descriptions == (32 * MiB, 65536)


def test_encrypt_is_a_per_tenant_switch_off_by_default():
    limits = parse_limits({"a": {"encrypt": True}, "b": {}}, "tokens.yaml", {"a", "b"})
    assert limits["a"].encrypt and not limits["b"].encrypt and not Limits().encrypt
    with pytest.raises(ConfigError, match=r"tenants\.a\.encrypt: expected true or false"):
        parse_limits({"a": {"encrypt": "yes"}}, "tokens.yaml", {"a"})


def test_redis_bytes_and_the_per_tenant_redis_url(tmp_path):
    """``redis_bytes`` parses as a size; ``{tenant}`` in --redis gives each tenant its user,
    password file, prefix and budget; a prefix without ``{tenant}`` is refused by name."""
    from kvstore.server.redis_tenants import budgets_of, tenant_configs

    limits = parse_limits({"a": {"redis_bytes": "2MiB"}}, "tokens.yaml", ["a", "b"])
    assert limits["a"].redis_bytes == 2 << 20
    for t in "ab":
        (tmp_path / f"redis-{t}.password").write_text(f"pw-{t}\n")
    url = f"redis://kvstore-{{tenant}}@h:6379/0?password_file={tmp_path}/redis-{{tenant}}.password"
    cfgs = tenant_configs(url + "&key_prefix=kvstore:{tenant}:", budgets_of({"a": limits["a"], "b": Limits()}))
    assert (cfgs["a"].username, cfgs["a"].password, cfgs["a"].key_prefix, cfgs["a"].budget_bytes) == (
        "kvstore-a",
        "pw-a",
        "kvstore:a:",
        2 << 20,
    )
    assert (cfgs["b"].password, cfgs["b"].budget_bytes) == ("pw-b", 0)
    with pytest.raises(ConfigError, match="key_prefix"):
        tenant_configs(url, {"a": None, "b": None})
    with pytest.raises(ConfigError, match="no tenants"):
        tenant_configs(url, {})
    from kvstore.server.redis_tenants import redis_specs

    with pytest.raises(ConfigError, match=r"tenants a have redis_bytes but --redis does not name \{tenant\}"):
        redis_specs("redis://h:6379/0", {"a": limits["a"]})
    assert redis_specs("redis://h:6379/0", {"b": Limits()}) == [("redis://h:6379/0", {})]
