"""``StoreClient`` over the store's raw TCP data channel (``transport="tcp"``) against a real
``kvstore serve``: round trips of every size into the caller's buffer, how ``auto`` picks
its plane (shm, else tcp, else gRPC streams), tenants, TLS with client certificates on the
data port, and a server restarted under a client's pooled connections."""

from __future__ import annotations

import asyncio
import socket
import ssl

import numpy as np
import pytest
import yaml

from kvstore import codec
from kvstore.client.store_client import StoreClient
from kvstore.errors import ConfigError, TierError, TierUnavailableError
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.chain import Chain, namespace
from tests.kits.data_channel import RawData
from tiers.base import PutResult

KiB, MiB = 1 << 10, 1 << 20
CHAIN = Chain(namespace("data-channel-test"))
TOKENS = {"ta": ("a", ["read", "write", "shm"]), "tb": ("b", ["read", "write"]), "ta-noshm": ("a", ["read", "write"])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "256MiB")


@pytest.fixture(scope="module")
def tenant_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    tokens = work / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {"tokens": [{"token": t, "tenant": ten, "permissions": perms} for t, (ten, perms) in TOKENS.items()]}
        )
    )
    proc = StoreProcess(work, "--host-capacity", "64MiB", "--auth-tokens", str(tokens)).start()
    yield proc
    assert proc.terminate(30) == 0


async def server_counters(client: StoreClient) -> dict[str, float]:
    return (await client.stats())["server_counters"]


@pytest.mark.parametrize("size", [KiB, MiB, 3 * MiB + 5, 32 * MiB])
async def test_round_trip(store, size):
    _, hashes, keys = CHAIN.links(2, seed=size)
    obj = CHAIN.seal(keys[1], size, seed=size)
    buf = np.zeros(size + 100, np.uint8)
    async with await StoreClient.connect(store.target, transport="tcp") as client:
        assert client.uses_tcp and not client.uses_shm and client.tcp_refusal == ""
        assert await client.put(keys[1], obj, hashes[0]) is PutResult.STORED
        assert await client.put(keys[1], obj, hashes[0]) is PutResult.EXISTS
        assert tuple(await client.lookup(keys[1:])) == (1, ("host",), (size,))
        assert await client.read_into(keys[1], memoryview(buf)) == size
        assert np.array_equal(buf[:size], obj)  # header rekeyed back to our key
        assert codec.decode_header(buf[:size]).parent == hashes[0]
        assert not buf[size:].any()  # nothing written past the object
        assert await client.delete(keys[1]) is True
        assert await client.read_into(keys[1], memoryview(buf)) is None
        c = client.counters
        assert (c.puts, c.put_exists, c.hits, c.misses, c.corrupt, c.bytes_read) == (1, 1, 1, 1, 0, size)
        server = await server_counters(client)
        assert server["store.gets.tcp.host"] >= 1 and server["store.get_misses.tcp"] >= 1
        assert (server["host.refs_held"], server["puts_in_flight"], server["host.pending"]) == (0, 0, 0)


async def test_a_buffer_too_small_is_a_clear_error_and_the_client_goes_on(store):
    keys = CHAIN.keys(1, seed=40)
    obj = CHAIN.seal(keys[0], 2 * MiB, 40)
    async with await StoreClient.connect(store.target, transport="tcp") as client:
        assert await client.put(keys[0], obj) is PutResult.STORED
        with pytest.raises(ConfigError, match="cannot hold"):
            await client.read_into(keys[0], memoryview(np.empty(MiB, np.uint8)))
        buf = np.empty(2 * MiB, np.uint8)
        assert await client.read_into(keys[0], memoryview(buf)) == 2 * MiB and np.array_equal(buf, obj)
        assert await client.delete(keys[0])
        assert (await server_counters(client))["host.refs_held"] == 0


async def test_auto_picks_shm_then_tcp_then_streams(tenant_store, tmp_path):
    target = tenant_store.target
    async with await StoreClient.connect(target, token="ta") as same_host:
        assert same_host.uses_shm and not same_host.uses_tcp
    async with await StoreClient.connect(target, token="ta-noshm") as no_shm:
        assert not no_shm.uses_shm and no_shm.uses_tcp and "shm permission" in no_shm.shm_refusal
    async with await StoreClient.connect(target, token="ta", transport="tcp") as forced:
        assert forced.uses_tcp and not forced.uses_shm
    async with await StoreClient.connect(target, token="ta", transport="stream") as stream:
        assert not stream.uses_tcp and not stream.uses_shm
    proc = StoreProcess(tmp_path, "--host-capacity", "16MiB", "--data-channel", "false").start()
    try:
        async with await StoreClient.connect(proc.target, transport="stream") as c:
            assert c.info.data_port == 0
        async with await StoreClient.connect(proc.target, token=None, transport="auto") as c:
            assert c.uses_shm
        with pytest.raises(ConfigError, match="offers no data channel"):
            await StoreClient.connect(proc.target, transport="tcp")
    finally:
        assert proc.terminate(30) == 0


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
    """Pipe one connection to 127.0.0.1:``port`` (both ways) until either side closes."""
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    try:
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    except asyncio.CancelledError:  # the test is over
        writer.close()
        up_writer.close()


async def test_auto_falls_back_to_streams_when_the_data_port_is_unreachable(tenant_store):
    """Clients reach gRPC through a forwarder on 127.0.0.2 (as through a firewall that lets
    only the gRPC port through); the data port is not open there.  ``auto`` streams over
    gRPC and says why; ``tcp`` fails at connect."""
    grpc_port = int(tenant_store.target.rpartition(":")[2])
    forwarder = await asyncio.start_server(lambda r, w: _forward(r, w, grpc_port), "127.0.0.2", 0)
    target = f"127.0.0.2:{forwarder.sockets[0].getsockname()[1]}"
    keys = CHAIN.keys(1, seed=45)
    obj = CHAIN.seal(keys[0], MiB, 45)
    buf = np.empty(MiB, np.uint8)
    try:
        async with await StoreClient.connect(target, token="ta-noshm", transport="auto") as c:
            assert not c.uses_shm and not c.uses_tcp and "127.0.0.2" in c.tcp_refusal
            assert await c.put(keys[0], obj) is PutResult.STORED  # over gRPC streams
            assert await c.read_into(keys[0], memoryview(buf)) == MiB and np.array_equal(buf, obj)
            assert await c.delete(keys[0])
        with pytest.raises(TierUnavailableError, match="data channel 127.0.0.2"):
            await StoreClient.connect(target, token="ta-noshm", transport="tcp")
    finally:
        forwarder.close()


def test_a_data_port_in_use_stops_the_server_at_start(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = StoreProcess(tmp_path, "--host-capacity", "16MiB", "--data-port", str(port))
        with pytest.raises(TierError, match="cannot listen for the data channel"):
            proc.start()


async def test_tenants_are_isolated_on_the_data_channel(tenant_store):
    keys = CHAIN.keys(1, seed=41)
    obj = CHAIN.seal(keys[0], 2 * MiB, 41)
    buf = np.empty(len(obj), np.uint8)
    async with (
        await StoreClient.connect(tenant_store.target, token="ta", transport="tcp") as a,
        await StoreClient.connect(tenant_store.target, token="tb", transport="tcp") as b,
    ):
        assert (a.info.tenant, b.info.tenant) == ("a", "b") and a.uses_tcp and b.uses_tcp
        assert await a.put(keys[0], obj) is PutResult.STORED
        assert await b.read_into(keys[0], memoryview(buf)) is None  # B cannot read it
        assert await b.put(keys[0], obj) is PutResult.STORED  # B's own copy
        assert await b.read_into(keys[0], memoryview(buf)) == len(obj) and np.array_equal(buf, obj)
        assert await a.delete(keys[0]) and await b.delete(keys[0])


async def test_tls_with_client_certificates_on_the_data_channel(tmp_path):
    from kvstore.testing.tls_files import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    proc = StoreProcess(
        tmp_path,
        "--host-capacity",
        "64MiB",
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        "--tls-client-ca",
        str(tls.ca_cert),
    ).start()
    keys = CHAIN.keys(1, seed=42)
    obj = CHAIN.seal(keys[0], 8 * MiB + 3, 42)
    buf = np.empty(len(obj), np.uint8)
    mtls = dict(tls_ca=str(tls.ca_cert), tls_cert=str(tls.client_cert), tls_key=str(tls.client_key))
    try:
        async with await StoreClient.connect(proc.target, transport="tcp", **mtls) as client:
            assert client.uses_tcp
            assert await client.put(keys[0], obj) is PutResult.STORED
            assert await client.read_into(keys[0], memoryview(buf)) == len(obj)
            assert np.array_equal(buf, obj)
            port = client.info.data_port
        with RawData(port) as plain:  # plaintext on a TLS port
            plain.sock.sendall(b"KVD1" + bytes(34))
            assert plain.closed_by_server()
        no_cert = ssl.create_default_context(cafile=str(tls.ca_cert))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with RawData(port, tls=no_cert) as raw:  # TLS without a client certificate
                raw.hello(bytes(32))
        wrong_ca = ssl.create_default_context()  # the system roots do not know it
        with pytest.raises(ssl.SSLError):
            RawData(port, tls=wrong_ca)
    finally:
        assert proc.terminate(30) == 0


async def test_restart_on_the_same_ports_reconnects_once(tmp_path):
    """Pooled connections die with the server; the next request fails on one before any
    reply byte and is retried once on a new connection (a new ticket) without an error."""
    listen, data = free_port(), free_port()
    args = (
        "--listen",
        f"127.0.0.1:{listen}",
        "--data-port",
        str(data),
        "--host-capacity",
        "32MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
    )
    proc = StoreProcess(tmp_path, *args).start()
    keys = CHAIN.keys(1, seed=43)
    obj = CHAIN.seal(keys[0], 4 * MiB, 43)
    buf = np.empty(len(obj), np.uint8)
    try:
        async with await StoreClient.connect(proc.target, transport="tcp", timeout_s=10) as client:
            assert await client.put(keys[0], obj) is PutResult.STORED
            assert client.planes.data.opened == 1
            assert proc.terminate(30) == 0  # write-through to SSD first
            proc.start()
            await client.rpc.channel.channel_ready()
            assert await client.read_into(keys[0], memoryview(buf)) == len(obj)  # from SSD
            assert np.array_equal(buf, obj)
            assert (client.planes.data.retries, client.planes.data.opened) == (1, 2)
    finally:
        proc.kill()


async def test_a_new_data_port_after_restart_needs_a_refresh(tmp_path):
    proc = StoreProcess(tmp_path, "--host-capacity", "32MiB", "--listen", f"127.0.0.1:{free_port()}").start()
    keys = CHAIN.keys(1, seed=44)
    buf = np.empty(4096, np.uint8)
    try:
        async with await StoreClient.connect(proc.target, transport="tcp", timeout_s=5) as client:
            old = client.info.data_port
            proc.terminate(30)
            proc.start()  # same gRPC port, new data port
            await client.rpc.channel.channel_ready()
            with pytest.raises(TierUnavailableError, match="data channel"):
                await client.read_into(keys[0], memoryview(buf))
            await client.refresh()  # the breaker's probe does this
            assert client.info.data_port != old and client.uses_tcp
            assert await client.read_into(keys[0], memoryview(buf)) is None
    finally:
        proc.kill()


async def test_sigterm_with_pooled_connections_drains_and_exits_cleanly(tmp_path):
    """A client's idle pooled connections do not keep the server from stopping: SIGTERM
    cuts them, the store exits 0 (its data threads joined), and the client's next request
    is a transport error (a miss in a tier)."""
    proc = StoreProcess(tmp_path, "--host-capacity", "16MiB").start()
    keys = CHAIN.keys(1, seed=46)
    obj = CHAIN.seal(keys[0], 2 * MiB, 46)
    buf = np.empty(len(obj), np.uint8)
    async with await StoreClient.connect(proc.target, transport="tcp", timeout_s=5) as client:
        assert await client.put(keys[0], obj) is PutResult.STORED
        assert await client.read_into(keys[0], memoryview(buf)) == len(obj)  # a pooled connection
        assert await asyncio.to_thread(proc.terminate, 30) == 0
        assert "connection thread did not stop" not in proc.log_text()
        with pytest.raises(TierUnavailableError):
            await client.read_into(keys[0], memoryview(buf))
