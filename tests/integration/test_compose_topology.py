"""The docker-compose topology, run from the compose file's own commands as local processes.

There is no Docker engine on the test machines, so the services of ``docker-compose.yml``
(redis, the store process, the engine) are started here from the very ``command`` and
``healthcheck`` lists in the file, with ``${VAR:-default}`` pointed at free ports and temp
directories.  The engine runs the main job against the store with no SSD of its own: it
exits 0 only when its outputs matched the recompute reference and engine 2 (a new process)
hit what engine 1 left in the store.  Where ``docker info`` succeeds, the same test then
runs the real ``docker compose up``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvstore.testing.redis_proc import free_port

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
BIN = {"python": [sys.executable], "kvstore": [sys.executable, "-m", "kvstore"],
       "redis-server": [shutil.which("redis-server") or "redis-server"],
       "redis-cli": [shutil.which("redis-cli") or "redis-cli"]}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` substitution."""
    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in env and env[name] != "":
            return env[name]
        if default is None:
            raise AssertionError(f"compose file uses ${{{name}}} without a default")
        return default
    return _VAR.sub(sub, value)


def local_command(argv: list[str], env: dict[str, str]) -> list[str]:
    argv = [interpolate(a, env) for a in argv]
    return BIN.get(argv[0], [argv[0]]) + argv[1:]


def wait_healthy(service: dict, env: dict[str, str], proc: subprocess.Popen, timeout: float) -> None:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", test
    cmd = local_command(test[1:], env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{cmd[0]} service exited with {proc.returncode}"
        if subprocess.run(cmd, capture_output=True, timeout=30, env={**os.environ, **env}).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"health check {cmd} never passed")


def test_compose_file_declares_the_topology():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert set(services) == {"redis", "tokens", "kvstore", "engine"}
    assert services["engine"]["depends_on"]["kvstore"]["condition"] == "service_healthy"
    assert services["kvstore"]["depends_on"]["tokens"]["condition"] == "service_completed_successfully"
    assert "--auth-tokens" in services["kvstore"]["command"]              # generated tokens, never open
    assert "--store-token-file" in services["engine"]["command"]
    assert services["kvstore"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["engine"]["ipc"] == "service:kvstore"  # the shm data plane across containers
    assert "--store-target" in services["engine"]["command"]
    assert "--redis" in services["kvstore"]["command"]


def test_compose_topology_as_local_processes(tmp_path):
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(free_port()), "KVSTORE_HOST": "127.0.0.1",
           "KVSTORE_PORT": str(free_port()), "KVSTORE_METRICS_PORT": str(free_port()),
           "KVSTORE_EVENTS_PORT": str(free_port()), "ENGINE_EVENTS_PORT": str(free_port()),
           "KVSTORE_DATA": str(tmp_path / "data"), "ENGINE_WORKDIR": str(tmp_path / "work"),
           "KVSTORE_RUN": str(tmp_path / "run"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    (tmp_path / "data").mkdir()
    procs: list[subprocess.Popen] = []
    logs = {}

    def start(name: str) -> subprocess.Popen:
        logs[name] = open(tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen(local_command(spec[name]["command"], env), cwd=tmp_path,
                                stdout=logs[name], stderr=subprocess.STDOUT, env={**os.environ, **env})
        procs.append(proc)
        return proc

    try:
        tokens = subprocess.run(local_command(spec["tokens"]["command"], env), cwd=tmp_path, capture_output=True,
                                env={**os.environ, **env})   # this checkout's kvstore (PYTHONPATH)
        assert tokens.returncode == 0, tokens.stderr
        wait_healthy(spec["redis"], env, start("redis"), timeout=30)
        wait_healthy(spec["kvstore"], env, start("kvstore"), timeout=60)
        engine = subprocess.run(local_command(spec["engine"]["command"], env), cwd=ROOT,
                                capture_output=True, text=True, timeout=1500, env={**os.environ, **env})
        out = engine.stdout + engine.stderr[-3000:]
        assert engine.returncode == 0, out
        assert "result: PASS" in engine.stdout, out
        assert "engine 2 hit tokens from lower tiers: {'remote'" in engine.stdout, out
        assert "MISMATCH" not in engine.stdout, out
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{env['KVSTORE_METRICS_PORT']}/metrics", timeout=10).read().decode()
        hits = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("kvstore_server_lookup_hits_total{"))
        assert hits > 0, metrics[:2000]
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()
    assert procs[1].returncode == 0, (tmp_path / "kvstore.log").read_text()[-3000:]  # graceful
    if docker_available():  # the real thing, where a Docker engine answers (none on CI machines)
        run = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "up", "--build",
                              "--abort-on-container-exit", "--exit-code-from", "engine"],
                             cwd=ROOT, capture_output=True, text=True, timeout=3600)
        assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]


def docker_available() -> bool:
    docker = shutil.which("docker")
    return docker is not None and subprocess.run([docker, "info"], capture_output=True).returncode == 0
