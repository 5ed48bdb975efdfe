"""Same-host tenants as separate users (issue 22, part 3), against a real ``kvstore serve``: the
shared-memory gate admits a tenant's session only from the uid/gid its tokens-file entry names
(the token decides the tenant), so tenant a's own user puts and gets byte-exact objects while
tenant b's user presenting a's token is refused, counted, and gets no descriptor.  A read-only
descriptor stays read-only for a uid other than the store's: no writable mapping, no writable
reopen through /proc/self/fd, no seal that would lock the writer out; and a tenant's user reads
neither the store's nor another tenant client's environment, nor the tokens file, nor the
store's descriptors.  Each refusal is shown beside a control where the same step succeeds.

Users: ``kvs-tenant-a`` and ``kvs-tenant-b`` (tests.kits.second_uid).  Cost: about 10 s (one
store process, a handful of child interpreters).
"""

from __future__ import annotations

import os

import grpc
import pytest
import yaml

from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.data_channel import ticket_of
from tests.kits.hostile import admin_counters, keys
from tests.kits.second_uid import json_as, spawn_as, tenant_user
from tests.kits.store_calls import StoreClient

Code = grpc.StatusCode
PRELOAD = (
    "json",
    "errno",
    "fcntl",
    "mmap",
    "socket",
    "grpc",
    "numpy",
    "kvstore.wire.shm",
    "kvstore.client.shmsession",
    "tests.kits.store_calls",
    "tests.kits.hostile",
)
F_SEAL_FUTURE_WRITE = 0x0010


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store whose tenant a belongs to ``kvs-tenant-a`` and tenant b to ``kvs-tenant-b`` (uid and
    group); tenant s names no uid (the store's own uid only)."""
    work = tmp_path_factory.mktemp("tenant-uids")
    (ua, ga), (ub, gb) = tenant_user("tenant-a"), tenant_user("tenant-b")
    os.chmod(work, 0o755)  # the children may reach the store's socket dir
    tokens = work / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
                    {"token": "tok-a-ro", "tenant": "a", "permissions": ["read", "shm"]},
                    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
                    {"token": "tok-s", "tenant": "s", "permissions": ["read", "write", "shm"]},
                    {"token": "tok-s-ro", "tenant": "s", "permissions": ["read", "shm"]},
                    {"token": "tok-ops", "tenant": "ops", "permissions": ["read", "admin"]},
                ],
                "tenants": {"a": {"uid": ua}, "b": {"uid": ub, "gid": gb}},
            }
        )
    )
    os.chmod(tokens, 0o600)
    store = StoreProcess(work, "--host-capacity", "48MiB", "--auth-tokens", str(tokens), "--metrics-port", "0").start()
    yield {"store": store, "a": (ua, ga), "b": (ub, gb), "tokens": str(tokens)}
    assert store.terminate(30) == 0


GATE = """
import errno, fcntl, json, mmap, os, socket
from kvstore.wire import shm as shmwire
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as err:
        out[name] = errno.errorcode[err.errno]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(20)
sock.connect(PATH)
sock.sendall(shmwire.encode_hello(bytes.fromhex(TICKET), TOKEN))
data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
reply = shmwire.decode_reply(data[:shmwire.REPLY.size])
out["code"], out["fds"], out["writable"] = reply.code, len(fds), reply.writable
if fds:
    fd = fds[0]
    size = os.fstat(fd).st_size
    attempt("map_write", lambda: mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close())
    attempt("map_read", lambda: mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ).close())
    attempt("reopen_ro", lambda: os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)))
    attempt("reopen_rw", lambda: os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR)))
    attempt("seal", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEAL))
print(json.dumps(out))
"""

PROBE = """
import errno, json, os
out = {}
for name, path in PATHS.items():
    try:
        if name.endswith("fd"):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        out[name] = "ok"
    except OSError as err:
        out[name] = errno.errorcode[err.errno]
print(json.dumps(out))
"""


def at_gate(world: dict, who: tuple[int, int] | None, token: str, seal: int = 0) -> dict:
    """A raw hello with ``token`` (and a fresh ticket of it) from ``who`` (None: this process, root)."""
    with StoreClient(world["store"].target, token) as client:
        path, ticket = client.hello().shm_socket, ticket_of(client)[0]
        code = f"PATH = {path!r}\nTICKET = {ticket.hex()!r}\nTOKEN = {token!r}\nSEAL = {seal}\n" + GATE
        if who is None:
            scope: dict = {}
            exec(compile(code.replace("print(json.dumps(out))", "sock.close()"), "gate", "exec"), scope)
            return scope["out"]
        return json_as(*who, code, PRELOAD)


def shm_round_trip(world: dict) -> dict:
    """As a's user: put three objects through a's pool and read them back; bytes compared."""
    code = f"""
import json
import numpy as np
from tests.kits.hostile import keys
from tests.kits.store_calls import MiB, Objects, StoreClient
objects, out = Objects(1 * MiB), {{}}
with StoreClient({world["store"].target!r}, "tok-a") as a:
    for i, key in enumerate(keys(3, seed=7)):
        obj = bytes(objects.make(key, 1 * MiB, seed=i))
        out[f"put{{i}}"] = a.put_shm(key, memoryview(obj))
        buf = np.empty(1 * MiB, np.uint8)
        n = a.get_shm(key, buf)
        out[f"same{{i}}"] = n == len(obj) and buf[:n].tobytes() == obj
    out["writable"] = a.open_session().writable
print(json.dumps(out))
"""
    return json_as(*world["a"], code, PRELOAD)


def test_a_tenants_own_user_puts_and_gets_through_its_pool(world):
    out = shm_round_trip(world)
    assert out["writable"] is True
    assert [out[f"put{i}"] for i in range(3)] == [pb.PUT_OUTCOME_STORED] * 3
    assert [out[f"same{i}"] for i in range(3)] == [True] * 3
    with StoreClient(world["store"].target, "tok-a") as a:  # the store holds what a's user wrote
        assert a.lookup(keys(3, seed=7)).hits == 3


def test_another_tenants_user_with_as_token_is_refused_counted_and_gets_no_descriptor(world):
    before = admin_counters(world["store"].target).get("store.failures.shm_uid", 0)
    refused = at_gate(world, world["b"], "tok-a")
    assert (refused["code"], refused["fds"]) == (Code.PERMISSION_DENIED.value[0], 0)
    own = at_gate(world, world["b"], "tok-b")  # control: b's user, b's token
    assert (own["code"], own["fds"], own["writable"]) == (0, 1, True)
    assert at_gate(world, world["a"], "tok-a")["code"] == 0  # control: a's user, a's token
    root = at_gate(world, None, "tok-s")  # a tenant without a uid: the store's
    assert (root["code"], root["fds"]) == (0, 1)
    nobody = at_gate(world, (65534, 65534), "tok-s")  # ... and nobody else's
    assert (nobody["code"], nobody["fds"]) == (Code.PERMISSION_DENIED.value[0], 0)
    after = admin_counters(world["store"].target)["store.failures.shm_uid"]
    assert after == before + 2


def test_a_read_only_descriptor_stays_read_only_for_the_tenants_user(world):
    reader = at_gate(world, world["a"], "tok-a-ro", seal=F_SEAL_FUTURE_WRITE)
    assert (reader["code"], reader["fds"], reader["writable"]) == (0, 1, False)
    assert reader["map_read"] == "ok"  # the descriptor works for reading
    assert reader["map_write"] == "EACCES"
    assert reader["reopen_rw"] == reader["reopen_ro"] == "EACCES"  # the pool is 0600, the store's
    assert reader["seal"] == "EPERM"
    writer = at_gate(world, world["a"], "tok-a")  # control: the writer's descriptor
    assert (writer["map_write"], writer["seal"]) == ("ok", "ok")  # maps writable; seals (none) land
    same_uid = at_gate(world, None, "tok-s-ro")  # control: within the store's uid
    assert same_uid["writable"] is False and same_uid["reopen_rw"] == "ok"  # ... the reopen works
    out = shm_round_trip(world)  # and a's writer still writes
    assert [out[f"same{i}"] for i in range(3)] == [True] * 3


def test_a_tenants_user_reads_no_environment_token_file_or_store_descriptor(world):
    store = world["store"]
    client = spawn_as(
        *world["a"],
        "import sys, time\nprint('up', flush=True)\ntime.sleep(60)\n",
        env={"KVSTORE_TOKEN": "tok-a-secret-in-env"},
    )
    try:
        assert client.stdout.readline().strip() == "up"
        paths = {
            "store_environ": f"/proc/{store.pid}/environ",
            "store_fd": f"/proc/{store.pid}/fd",
            "client_environ": f"/proc/{client.pid}/environ",
            "tokens": world["tokens"],
            "own_environ": "/proc/self/environ",
        }
        for name, path in paths.items():  # control: root reads every one
            assert os.listdir(path) if name.endswith("fd") else open(path, "rb").read(1), name
        b_sees = json_as(*world["b"], f"PATHS = {paths!r}\n" + PROBE, ("json", "errno"))
        assert b_sees["own_environ"] == "ok"  # the probe itself works
        assert {k: v for k, v in b_sees.items() if k != "own_environ"} == {
            "store_environ": "EACCES",
            "store_fd": "EACCES",
            "client_environ": "EACCES",
            "tokens": "EACCES",
        }
        a_sees = json_as(*world["a"], f"PATHS = {paths!r}\n" + PROBE, ("json", "errno"))
        assert a_sees["client_environ"] == "ok"  # within one uid: readable (why one uid each)
        assert a_sees["store_environ"] == a_sees["tokens"] == "EACCES"
    finally:
        client.kill()
        client.wait(10)
