"""`docker compose up` of Redis, the store and a vLLM engine, for real, with three faults.

`make compose-test` (and `make test`) first runs scripts/compose/prepare.sh: Docker, dockerd,
the base image and the images.  This test then runs docker-compose.yml with
docker-compose.loopback.yml over it (every container on the host's loopback, ports picked
free here) and secrets made for this run, as one compose session:

1. ``up``: Redis, then ``kvstore serve`` (healthy: grpc.health.v1 over TLS), then the
   engine: the main job (reference, engine 1, engine 2 in a new process; ``--no-ssd``, so
   engine 2's hits can only come from the store), paused before request doc-1 of engine 2.
2. There the store's ``/metrics`` must show lookup hits, and its counters puts and gets
   through shared memory (the pool handed over the socket in the shared volume).  Fault: ``docker kill`` of the
   store; engine 2 goes on and must recompute the rest with outputs still matching: the engine container exits 0
   with ``result: PASS``.
   Meanwhile a SUB socket on the engine's vLLM publisher decodes, with vLLM's structs, our
   host tier's ``BlockStored`` events (tokens and one hash each) in vLLM's own stream.
3. Fault: the store's container started again after that SIGKILL on the same SSD volume,
   then restarted gracefully: each time every SSD object is back (indexed by its scan).
4. Fault: Redis's container stopped and started: the store's Redis breaker opens on the
   lookups made meanwhile, then closes again.
5. ``down -v`` leaves no container, volume, network or shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.testing.redis_proc import free_port

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "docker-compose.yml", ROOT / "docker-compose.loopback.yml"]
CACHE = Path(
    os.environ.get("KVSTORE_COMPOSE_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore-compose"
)
CONTAINER_UID = 10001
PAUSE = "doc-1"


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """The command's stdout (``docker logs``: the container's stdout and stderr, merged)."""
    cli = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else "docker"
    done = subprocess.run(
        [cli, *args],
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
        stderr=subprocess.STDOUT if args[0] == "logs" else subprocess.PIPE,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr or ''}")
    return done.stdout


class Compose:
    """One compose project (its own name) over both files, with the test's environment."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name, self.env = name, {**os.environ, **env}
        cli = shutil.which("docker-compose")
        self.cli = [cli] if cli else ["docker", "compose"]

    def __call__(self, *args: str, timeout: float = 300) -> str:
        files = [a for f in FILES for a in ("-f", str(f))]
        done = subprocess.run(
            [*self.cli, "-p", self.name, *files, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=ROOT,
        )
        assert done.returncode == 0, f"compose {' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    def container(self, service: str) -> str:
        return self("ps", "-q", service).strip().splitlines()[0]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """The images prepare.sh built; a missing one fails (run `make compose-images`)."""
    env_file = CACHE / "env"
    assert env_file.exists(), f"{env_file} is missing: run `make compose-images` (scripts/compose/prepare.sh)"
    env = dict(line.split("=", 1) for line in env_file.read_text().split())
    for image in ("kvstore-store", "kvstore-engine", env["REDIS_IMAGE"]):
        docker("image", "inspect", image)
    return env


def test_compose_file_keeps_its_own_network_and_secrets():
    """What users run: no host network, no published port, credentials only as secrets."""
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = spec["services"]
    assert set(services) == {"redis", "kvstore", "engine"}
    assert spec["networks"]["default"]["internal"] is True
    for name, svc in services.items():
        assert "network_mode" not in svc and "ports" not in svc, name
        assert not any("TOKEN" in k or "KEY" in k for k in svc.get("environment", {})), name
    assert "kvstore-run:/run/kvstore" in services["engine"]["volumes"]  # the store's shm socket
    assert "kvstore-run:/run/kvstore" in services["kvstore"]["volumes"]
    assert "/run/kvstore/shm.sock" in services["kvstore"]["command"]
    assert set(services["kvstore"]["secrets"]) >= {"store_tokens", "store_tls_cert", "store_tls_key"}
    loopback = yaml.safe_load((ROOT / "docker-compose.loopback.yml").read_text())["services"]
    assert all(s["network_mode"] == "host" for s in loopback.values())
    base, test = services["engine"]["command"], loopback["engine"]["command"]
    assert test[: len(base)] == base, "the loopback engine command must extend docker-compose.yml's"


def test_compose_up_engine_hits_store_and_survives_faults(images, tmp_path):
    env = loopback_env(tmp_path, images["REDIS_IMAGE"])
    compose = Compose(f"kvstore-test-{os.getpid()}", env)
    shm_before = uid_shm()
    ids: list[str] = []
    try:
        started = time.monotonic()
        compose("up", "-d", "--no-build")
        ids = compose("ps", "-q").split()
        engine, store, redis = (compose.container(s) for s in ("engine", "kvstore", "redis"))
        wait_for(
            lambda: (tmp_path / "barriers" / f"{PAUSE}.ready").exists(),
            1200,
            f"engine 2 reaching {PAUSE}",
            alive=engine,
        )
        print(f"engine 2 paused before {PAUSE} after {time.monotonic() - started:.0f} s", compose("ps"), sep="\n")
        hits = lookup_hits(env)
        assert hits > 0, "the store's /metrics shows no lookup hits from engine 2"
        before = settled_ssd(env)
        assert before["objects"] > 0, before
        planes = store_stats(env)["store"]
        print("store puts and gets by plane:", planes["puts"], planes["gets"])
        events = store_stats(env)["kv_events"]  # one stream per tenant, on the shared volume
        assert events["streams"]["engines"]["endpoint"] == "ipc:///run/kvstore/kv-events.engines", events
        assert events["published"]["events"] > 0, events
        for way in ("puts", "gets"):  # the same-host data plane, across containers (the socket volume)
            assert sum(n for k, n in planes[way].items() if k.startswith("shm.")) > 0, planes

        engine_events = EngineEvents(f"tcp://127.0.0.1:{env['ENGINE_EVENTS_PORT']}")  # vLLM's publisher
        docker("kill", store)  # fault 1: the store dies mid-run
        (tmp_path / "barriers" / f"{PAUSE}.go").touch()
        rc = int(docker("wait", engine, timeout=900).strip())
        out = docker("logs", engine, timeout=60)
        print(out[out.find("== engine 2") :], compose("ps"), sep="\n")
        assert rc == 0, out[-6000:]
        ours = engine_events.close()  # engine 2's rest: our host tier's stores, through vLLM's stream
        print(f"engine 2's KV events after the pause: {len(ours)} of our BlockStored (CPU)")
        assert ours and all(e.token_ids and len(e.block_hashes) == 1 for e in ours), ours[:3]
        assert "result: PASS" in out and "MISMATCH" not in out, out[-6000:]
        assert "engine 2 hit tokens from lower tiers: {'remote'" in out, out[-6000:]
        failures = [line for line in out.split("== engine 2")[1].splitlines() if line.startswith("  failures:")]
        assert failures and "remote:" in failures[0], f"engine 2 never saw the store die: {failures}"

        docker("start", store)  # fault 3: same volume, after SIGKILL
        assert_ssd_back(env, store, before, "after SIGKILL")
        docker("restart", store)  # ... and after a graceful stop
        assert_ssd_back(env, store, before, "after a graceful restart")

        docker("stop", redis)  # fault 2: Redis goes away
        breaker = wait_breaker(env, lambda b: b["breaker_opened"] >= 1 and b["breaker_open"] >= 1, "open")
        docker("start", redis)
        wait_healthy(redis)
        breaker = wait_breaker(env, lambda b: b["breaker_closed"] >= 1 and b["breaker_open"] == 0, "close")
        print(f"redis breaker: {breaker}; whole session {time.monotonic() - started:.0f} s")
    finally:
        compose("down", "-v", "--remove-orphans", timeout=120)
    assert_nothing_left(compose.name, ids, shm_before)


class EngineEvents:
    """A SUB socket on the engine container's vLLM publisher (``--kv-events-config``), read on
    a thread and decoded with vLLM's own structs: what a router next to the engine gets."""

    def __init__(self, endpoint: str) -> None:
        import zmq  # the test extra (pyzmq, msgspec) and vLLM's structs, from the test's venv
        from zmq.utils.monitor import recv_monitor_message

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        # Connected: the subscription goes out right after the handshake, so the publisher
        # (paused at a barrier until the test lets it go) has it before its next batch.
        assert monitor.poll(30_000), f"no connection to vLLM's publisher at {endpoint}"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        self.sub.disable_monitor()
        monitor.close(0)
        self.batches: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        while not self._stop.is_set():
            if self.sub.poll(50):
                _topic, seq, payload = self.sub.recv_multipart()
                assert len(seq) == 8
                self.batches.append(decode(payload))

    def close(self) -> list:
        """Stop reading; our tiers' ``BlockStored`` events in host DRAM (medium ``CPU``)."""
        from vllm.distributed.kv_events import BlockStored

        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        self.ctx.term()
        return [e for b in self.batches for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]


# ------------------------------------------------------------------------------ the set-up


def loopback_env(tmp: Path, redis_image: str) -> dict[str, str]:
    """Ports picked free on 127.0.0.1, this run's secrets, and the barrier directory."""
    secrets, barriers = tmp / "secrets", tmp / "barriers"
    subprocess.run([str(ROOT / "scripts/compose/secrets.sh"), str(secrets)], check=True, capture_output=True)
    barriers.mkdir()
    if os.geteuid() == 0:
        os.chown(barriers, CONTAINER_UID, CONTAINER_UID)
    else:
        barriers.chmod(0o777)
    loopback = "127.0.0.1"
    return {
        "REDIS_IMAGE": redis_image,
        "KVSTORE_SECRETS": str(secrets),
        "ENGINE_BARRIERS": str(barriers),
        "REDIS_BIND": loopback,
        "REDIS_HOST": loopback,
        "KVSTORE_LISTEN": loopback,
        "KVSTORE_HOST": loopback,
        "REDIS_PORT": str(free_port()),
        "KVSTORE_PORT": str(free_port()),
        "KVSTORE_METRICS_PORT": str(free_port()),
        "ENGINE_EVENTS_PORT": str(free_port()),
    }


# ------------------------------------------------------------------------------ the store


def store_stub(env: dict[str, str]):
    secrets = Path(env["KVSTORE_SECRETS"])
    creds = grpc.ssl_channel_credentials((secrets / "ca.crt").read_bytes())
    channel = grpc.secure_channel(f"127.0.0.1:{env['KVSTORE_PORT']}", creds)
    token = (secrets / "ops-token").read_text().strip()  # tenant ops: read, admin (the whole Stats)
    return channel, pb_grpc.KVStoreStub(channel), [("authorization", f"Bearer {token}")]


def store_stats(env: dict[str, str]) -> dict:
    channel, stub, auth = store_stub(env)
    with channel:
        return json.loads(stub.Stats(pb.StatsRequest(), metadata=auth, timeout=10).json)


def lookup_hits(env: dict[str, str]) -> float:
    """``kvstore_server_lookup_hits_total`` summed over tiers, from the store's /metrics."""
    url = f"http://127.0.0.1:{env['KVSTORE_METRICS_PORT']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstore_server_lookup_hits_total{")
    )


def settled_ssd(env: dict[str, str], timeout: float = 30) -> dict:
    """The SSD tier's stats once no put or write-through is in flight and two reads a second
    apart agree (engine 1's last saves may still be on their way when engine 2 pauses)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        doc = store_stats(env)
        ssd = doc["tiers"]["ssd"]
        now = (ssd["objects"], ssd["bytes_used"])
        if now == last and doc["puts_in_flight"] == 0 and doc["write_throughs_in_flight"] == 0:
            return ssd
        last = now
        time.sleep(1)
    raise AssertionError(f"the store's SSD tier never settled: {doc}")


def assert_ssd_back(env: dict[str, str], store: str, before: dict, when: str) -> None:
    wait_healthy(store)
    after = store_stats(env)["tiers"]["ssd"]
    assert (after["objects"], after["bytes_used"]) == (before["objects"], before["bytes_used"]), (when, before, after)
    assert after["corrupt"] == 0, (when, after)


def wait_breaker(env: dict[str, str], done, what: str, timeout: float = 60) -> dict:
    """Look up keys nobody stored (host and SSD miss, so Redis is asked) until the store's
    Redis breaker satisfies ``done``."""
    channel, stub, auth = store_stub(env)
    request = pb.LookupRequest(namespace=os.urandom(32), chunk_hashes=[os.urandom(32)], tag="r0")
    deadline = time.monotonic() + timeout
    with channel:
        while time.monotonic() < deadline:
            stub.Lookup(request, metadata=auth, timeout=10)
            breaker = json.loads(stub.Stats(pb.StatsRequest(), metadata=auth, timeout=10).json)["breakers"]["redis"]
            if done(breaker):
                return breaker
            time.sleep(0.2)
    raise AssertionError(f"the store's Redis breaker did not {what} within {timeout} s: {breaker}")


# ------------------------------------------------------------------------------ docker


def wait_for(ready, timeout: float, what: str, alive: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if alive and docker("inspect", "-f", "{{.State.Running}}", alive).strip() != "true":
            raise AssertionError(f"{what}: the container stopped\n{docker('logs', alive, check=False)[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(1)


def wait_healthy(container: str, timeout: float = 90) -> None:
    wait_for(
        lambda: docker("inspect", "-f", "{{.State.Health.Status}}", container).strip() == "healthy",
        timeout,
        f"{container} healthy",
        alive=container,
    )


def uid_shm() -> set[str]:
    """Host /dev/shm files owned by the containers' uid: none should ever appear (each
    container's /dev/shm is a tmpfs of its own, which Docker mounts and unmounts)."""
    mine = set()
    for entry in os.scandir("/dev/shm"):
        try:
            if entry.stat(follow_symlinks=False).st_uid == CONTAINER_UID:
                mine.add(entry.name)
        except FileNotFoundError:  # another test's segment, gone meanwhile
            pass
    return mine


def assert_nothing_left(project: str, ids: list[str], shm_before: set[str]) -> None:
    label = f"label=com.docker.compose.project={project}"
    assert docker("ps", "-aq", "--filter", label).split() == [], "containers left"
    assert docker("volume", "ls", "-q", "--filter", label).split() == [], "volumes left"
    assert docker("network", "ls", "-q", "--filter", label).split() == [], "networks left"
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if any(i in line for i in ids)]
    assert not mounts, f"mounts of this project's containers left (their /dev/shm): {mounts}"
    assert uid_shm() - shm_before == set(), f"shared memory left in /dev/shm: {uid_shm() - shm_before}"
