"""``kvstore bench lmcache-l2`` (or ``python -m harness.bench_lmcache_l2``): LMCache's hit TTFT
with kvstore as its L2, beside LMCache's own file-system L2 adapter (``fs_native``) and beside
recompute, in one run (docs/lmcache-l2.md).

Host side; engines run in child processes (``harness.kit.run_engine``), LMCache's multiprocess
server in another (``harness.bench_e2e.lmcache_peer.lmcache_server``), both with LMCache from
``--lmcache-site`` (``make lmcache``: ``.venv-lmcache``) on their PYTHONPATH.

1. An engine without a connector runs the prompts: the recompute TTFT and the reference
   outputs.
2. For each L2 (``kvstore``: our adapter over a ``kvstore serve`` started here, its host pool
   and an SSD directory; ``lmcache-fs``: LMCache's native file-system adapter, ``fs_native``,
   on a directory here): an LMCache server and an engine run the prompts (misses, written down to L2); the server is
   restarted (its L1 is gone) and a fresh engine runs them again, so every hit is an L2 hit.
3. Prints, per L2, the hit TTFT p50 and p95 beside the recompute TTFT of step 1, the keys
   LMCache prefetched from L1 and L2 (its own log) and whether the outputs equal the reference.

Exit status 0 only when every setup's hit run prefetched from L2 only and matched the reference.
Speed is measured here, never asserted in tests; the machine may be shared, so compare the
figures of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from harness import kit, tinymodel
from harness.bench_e2e.lmcache_peer import connector_config, lmcache_server
from kvstore.testing.serve_proc import StoreProcess

CHUNK = 256  # LMCACHE_ARGS' --chunk-size
TOKEN = "tok-bench-lmcache"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.bench_lmcache_l2", description=__doc__.split("\n")[0])
    _add_arguments(p)
    return p.parse_args(argv)


def register(suites) -> None:
    """``kvstore bench lmcache-l2`` (a ``kvstore.bench`` entry point)."""
    p = suites.add_parser("lmcache-l2", help="LMCache's hit TTFT with kvstore as its L2, beside its fs_native L2")
    _add_arguments(p)
    p.set_defaults(func=command)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench", choices=sorted(tinymodel.GEOMETRIES), help="harness.tinymodel name")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8 * CHUNK, help="tokens per prompt (default 2048)")
    p.add_argument("--lmcache-site", type=Path, default=kit.PROJECT_ROOT / ".venv-lmcache")
    p.add_argument("--work", type=Path, default=None, help="keep logs here (default: a temporary directory)")


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _prefetched(log: str) -> tuple[int, int]:
    """LMCache's own account of its prefetches: keys found in (L1, L2), summed."""
    found = re.findall(r"Prefetch request completed.*?\((\d+) L1, (\d+) L2\)", log)
    return sum(int(a) for a, _ in found), sum(int(b) for _, b in found)


def _wait(done: Callable[[], bool], timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.5)
    return False


def _l2_spec(spec: dict) -> list[str]:
    return ["--l2-adapter", json.dumps(spec)]


def _setups(work: Path, store: StoreProcess, chunks: int) -> dict[str, tuple[list[str], Callable[[], bool]]]:
    """Per L2: its ``--l2-adapter`` arguments and when the first run's objects are all written down."""
    token = work / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    ours = {
        "type": "plugin",
        "module_path": "adapters.lmcache_l2.adapter",
        "class_name": "KVStoreL2Adapter",
        "adapter_params": {"store_target": store.target, "store_token_file": str(token)},
    }
    fs_dir = work / "lmcache-fs"
    fs_dir.mkdir()
    url = store.metrics_url or ""
    return {
        "kvstore": (_l2_spec(ours), lambda: _metric(url, "kvstore_server_puts_total") >= chunks),
        "lmcache-fs": (
            _l2_spec({"type": "fs_native", "base_path": str(fs_dir)}),
            lambda: sum(1 for p in fs_dir.rglob("*") if p.is_file()) >= chunks,
        ),
    }


def _run_setup(
    name: str,
    l2_args: list[str],
    written: Callable[[], bool],
    model: Path,
    workload: kit.Workload,
    work: Path,
    site: Path,
) -> dict:
    path = f"{site}{os.pathsep}{kit.PROJECT_ROOT}"
    env, log = {**os.environ, "PYTHONPATH": path}, work / f"{name}-lmcache.log"
    out: dict = {}
    for phase in ("fill", "hit"):
        offset = log.stat().st_size if log.exists() else 0
        with lmcache_server(log, extra_args=l2_args, env=env) as port:
            out[phase] = kit.run_engine(
                model,
                connector_config(port),
                workload,
                extra_env={"PYTHONPATH": path},
                out_json=work / f"{name}-{phase}",
            )
            if phase == "fill":
                out["written"] = _wait(written)
        out[f"{phase}_log"] = log.read_bytes()[offset:].decode(errors="replace")
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _report(reference: kit.EngineResult, results: dict[str, dict], chunks: int) -> int:
    floor = kit.percentiles([r.ttft_s for r in reference.requests])
    print(f"\nrecompute (no connector): TTFT p50 {_ms(floor.p50)} ms, p95 {_ms(floor.p95)} ms")
    print(f"{'L2':<12} {'hit p50 ms':>10} {'hit p95 ms':>10} {'recompute p50':>13} {'hit/recompute':>13} "
          f"{'L1,L2 keys':>10}  outputs")  # fmt: skip
    ok = True
    for name, out in results.items():
        hit = kit.percentiles([r.ttft_s for r in out["hit"].requests])
        l1, l2 = _prefetched(out["hit_log"])
        cmp = kit.compare_outputs(reference, out["hit"])
        ratio = "-" if hit.p50 is None or not floor.p50 else f"{hit.p50 / floor.p50:.2f}"
        print(f"{name:<12} {_ms(hit.p50):>10} {_ms(hit.p95):>10} {_ms(floor.p50):>13} {ratio:>13} "
              f"{f'{l1},{l2}':>10}  {'equal' if cmp else 'DIFFER: ' + '; '.join(cmp.mismatches[:3])}")  # fmt: skip
        good = bool(cmp) and l1 == 0 and l2 >= chunks and out["written"]
        if not good:
            print(f"  {name}: expected {chunks} L2 keys and none from L1 (written down in time: {out['written']})")
        ok = ok and good
    return 0 if ok else 1


def run(args: argparse.Namespace, work: Path) -> int:
    model = tinymodel.build_named(work / "model", args.model)
    vocab = tinymodel.GEOMETRIES[args.model].vocab
    g = kit.TokenSource(7, vocab)
    workload = kit.Workload(tuple(kit.Request(f"p{i}", g.take(args.prompt_len)) for i in range(args.prompts)))
    chunks = args.prompts * (args.prompt_len // CHUNK)
    print(f"{args.prompts} prompts of {args.prompt_len} tokens ({chunks} full chunks), model {args.model}", flush=True)
    reference = kit.run_engine(model, None, workload, out_json=work / "reference")
    (work / "store").mkdir()
    tokens = work / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump({"tokens": [{"token": TOKEN, "tenant": "bench", "permissions": ["read", "write", "shm"]}]})
    )
    store_args = (
        "--host-capacity",
        "2GiB",
        "--ssd-dir",
        str(work / "ssd"),
        "--metrics-port",
        "0",
        "--auth-tokens",
        str(tokens),
    )
    with StoreProcess(work / "store", *store_args).start() as store:
        results = {
            name: _run_setup(name, l2_args, written, model, workload, work, args.lmcache_site)
            for name, (l2_args, written) in _setups(work, store, chunks).items()
        }
    return _report(reference, results, chunks)


def main(argv: list[str] | None = None) -> int:
    return command(_args(argv))


def command(args: argparse.Namespace) -> int:
    """The whole bench for parsed ``args`` (``main``, or ``kvstore bench lmcache-l2``)."""
    if not (args.lmcache_site / "lmcache").is_dir():
        print(f"error: no LMCache in {args.lmcache_site}: run `make lmcache`", file=sys.stderr)
        return 2
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        return run(args, args.work)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-lmcache-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
