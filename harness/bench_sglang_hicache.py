"""``kvstore bench sglang-hicache`` (or ``python -m harness.bench_sglang_hicache``): our HiCache
storage backend beside SGLang's own ``HiCacheFile``, same pages, same SGLang calls, one run
(docs/sglang-hicache.md).

Host side.  The measured part runs under SGLang's Python (``.venv-sglang``, ``make sglang``) as
a child, ``harness/sglang_hicache_bench_child.py``, which prints one JSON report: SGLang's host
pool (``MHATokenToKVPoolHost``), its page keys and its ``HiCacheController`` storage methods
(``_page_backup``, ``_storage_hit_query``, ``_page_transfer``) over each setup:

* ``kvstore-ssd``: our backend with an SSD directory only, SGLang's zero-copy page functions
  (``interface_v1``: ``batch_set_v1``/``batch_get_v1``); every page is fsynced;
* ``kvstore-ssd-generic``: the same backend through SGLang's generic page functions
  (``batch_set``/``batch_get`` of flat pages), the call path ``HiCacheFile`` takes;
* ``kvstore-serve``: our backend over a real ``kvstore serve`` started here (its host memory),
  zero-copy page functions;
* ``hicache-file``: SGLang's ``HiCacheFile`` on a directory (no fsync), generic page functions.

Per repeat and setup: the set of every page (through ``close()``, which writes our staged pages
down; "acked" is before it), a fresh backend (the restart), the hit query, and the get of every
page into the cleared host pool, compared byte for byte.  The limit, measured right before each
setup in each repeat: the same pages' bytes as plain files, one per page (write without fsync,
``exists``, ``readinto``), after an untimed ``os.sync()`` so no setup inherits another's dirty pages.
Figures are medians over the ``--repeats`` in which every page came back.  Exit status 1 if
any page of any setup was missing or differed, 2 without ``.venv-sglang``.  Speed is measured
here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from kvstore.bench.common import Row, print_rows, write_json
from kvstore.testing.serve_proc import StoreProcess

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("sglang_hicache_bench_child.py")
TOKEN = "tok-bench-hicache"
SETUPS = ("kvstore-ssd", "kvstore-ssd-generic", "kvstore-serve", "hicache-file")
LIMITS = {"set": "page files: write, no fsync", "hit": "page files: exists", "get": "page files: readinto"}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.bench_sglang_hicache", description=__doc__.split("\n")[0])
    _add_arguments(p)
    return p.parse_args(argv)


def register(suites) -> None:
    """``kvstore bench sglang-hicache`` (a ``kvstore.bench`` entry point)."""
    p = suites.add_parser("sglang-hicache", help="our SGLang HiCache backend beside SGLang's HiCacheFile")
    _add_arguments(p)
    p.set_defaults(func=command)


def _setups(value: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    bad = sorted(set(names) - set(SETUPS))
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown setup(s) {bad or value!r}; choose from {', '.join(SETUPS)}")
    return names


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=256, help="pages set and read per repeat (default 256)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument(
        "--layout", default="layer_first", choices=("layer_first", "page_first", "page_first_direct", "page_head")
    )
    p.add_argument("--repeats", type=int, default=5, help="figures are the median over these (default 5)")
    p.add_argument(
        "--page-cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold (default): every written file is dropped from the page cache before it is read back, "
        "so all reads come from the device; warm: reads find what the writes left in the page cache",
    )
    p.add_argument("--setups", type=_setups, default=list(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--sglang-python", type=Path, default=ROOT / ".venv-sglang" / "bin" / "python")
    p.add_argument("--work", type=Path, default=None, help="keep the directories and logs here (default: temporary)")
    p.add_argument("--json", help="write the rows as JSON to this file")


def page_bytes(args: argparse.Namespace) -> int:
    size = {"float16": 2, "bfloat16": 2, "float32": 4}[args.dtype]
    return 2 * args.layers * args.page_size * args.heads * args.head_dim * size  # K and V


def setup_specs(args: argparse.Namespace, store: StoreProcess | None, token_file: Path) -> dict[str, dict]:
    """What the child builds per setup (see ``harness/sglang_hicache_bench_child.py``)."""
    total = args.pages * page_bytes(args)
    ssd = {"ssd_dir": "", "ssd_capacity": str(4 * total + (64 << 20)), "host_capacity": "256MiB"}
    specs = {
        "kvstore-ssd": {"kind": "kvstore", "path": "v1", "extra": {**ssd, "interface_v1": 1}},
        "kvstore-ssd-generic": {"kind": "kvstore", "path": "generic", "extra": ssd},
        "hicache-file": {"kind": "hicache-file", "path": "generic", "extra": {}},
    }
    if store is not None:
        remote = {"store_target": store.target, "store_token_file": str(token_file), "host_capacity": "256MiB"}
        specs["kvstore-serve"] = {"kind": "kvstore", "path": "v1", "extra": {**remote, "interface_v1": 1}}
    return {name: specs[name] for name in args.setups}


def run_child(args: argparse.Namespace, work: Path, specs: dict[str, dict]) -> dict:
    child_args = {
        "pages": args.pages,
        "page_size": args.page_size,
        "layers": args.layers,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "layout": args.layout,
        "repeats": args.repeats,
        "page_cache": args.page_cache,
        "work": str(work / "pages"),
        "setups": specs,
    }
    (work / "pages").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(work / "child.log", "w") as log:
        proc = subprocess.run(
            [str(args.sglang_python), str(CHILD), json.dumps(child_args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=1800,
        )
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (work / "child.log").read_text()[-4000:]
        raise RuntimeError(f"the SGLang child failed ({proc.returncode}):\n{tail}")
    (work / "report.json").write_text(proc.stdout.strip().splitlines()[-1])  # every repeat's seconds
    return json.loads((work / "report.json").read_text())


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r["seconds"][key] for r in runs)


def good_runs(runs: list[dict], pages: int) -> list[dict]:
    """The repeats in which every page was set, found, read and equal (only they give figures)."""
    keys = ("set_pages", "hit_pages", "got_pages", "equal_pages")
    return [r for r in runs if "error" not in r and all(r[k] == pages for k in keys)]


def rows_of(report: dict, pages: int) -> list[Row]:
    """Per setup: set (acked and written down) and get in GB/s, the hit query in ms, each beside
    the page-files limit measured right before it; medians over the repeats in which every page
    came back."""
    nbytes = pages * report["page_bytes"]
    rows = []
    for name, runs in report["setups"].items():
        good = good_runs(runs, pages)
        if not good:
            continue
        limit = {k: _median([r["limit"] for r in good], k) for k in ("set", "hit", "get")}
        for label, key, lim in (("set acked", "set_acked", "set"), ("set", "set", "set"), ("get", "get", "get")):
            seconds = _median(good, key)
            rows.append(Row(f"{name} {label}", nbytes / seconds / 1e9, "GB/s", LIMITS[lim], nbytes / limit[lim] / 1e9))
        rows.append(
            Row(f"{name} hit query", _median(good, "hit") * 1e3, "ms", LIMITS["hit"], limit["hit"] * 1e3, "lower")
        )
    return rows


def check(report: dict, pages: int) -> list[str]:
    """What went wrong, per setup and repeat (empty: every page was set, found and equal, and
    the limit's files read back equal)."""
    problems = []
    for name, runs in report["setups"].items():
        for rep, r in enumerate(runs):
            lim = r["limit"]
            if lim["equal_pages"] != pages or lim["hit_pages"] != pages:
                problems.append(f"{name} repeat {rep}: limit: {lim['equal_pages']} equal, {lim['hit_pages']} found")
            if "error" in r:
                problems.append(f"{name} repeat {rep}: {r['error']}\n{r['tb'][-2000:]}")
                continue
            counts = {k: r[k] for k in ("set_pages", "hit_pages", "got_pages", "equal_pages")}
            if set(counts.values()) != {pages}:
                problems.append(f"{name} repeat {rep}: expected {pages} pages each, got {counts}")
    return problems


def print_details(report: dict, pages: int) -> None:
    """Pages per second, each beside its own limit, the restart, and the repeats that count."""
    print(f"\n{'setup':<20} {'path':<8} {'set/s':>7} {'limit':>7} {'get/s':>7} {'limit':>7} {'restart ms':>10}  "
          "repeats with every page back")  # fmt: skip
    for name, runs in report["setups"].items():
        good = good_runs(runs, pages)
        figures = " ".join(f"{'-':>7}" for _ in range(4)) + f" {'-':>10}"
        if good:
            lim = [r["limit"] for r in good]
            rates = [pages / _median(good, "set"), pages / _median(lim, "set")]
            rates += [pages / _median(good, "get"), pages / _median(lim, "get")]
            figures = " ".join(f"{v:>7.0f}" for v in rates) + f" {_median(good, 'open') * 1e3:>10.1f}"
        path = next((r["path"] for r in runs if "path" in r), "-")
        print(f"{name:<20} {path:<8} {figures}  {len(good)}/{len(runs)}")


def run(args: argparse.Namespace, work: Path) -> int:
    nbytes = args.pages * page_bytes(args)
    print(
        f"{args.pages} pages of {args.page_size} tokens ({page_bytes(args) >> 10} KiB each, {nbytes / 2**20:.0f} MiB), "
        f"{args.layers} layers, {args.heads} KV heads x {args.head_dim}, {args.dtype}, {args.layout}; "
        f"{args.repeats} repeat(s), page cache {args.page_cache}",
        flush=True,
    )
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    tokens = work / "tokens.yaml"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    grant = {"sha256": digest, "tenant": "bench", "permissions": ["read", "write", "shm"]}
    tokens.write_text(yaml.safe_dump({"tokens": [grant]}))
    capacity = str(2 * nbytes * args.repeats + (256 << 20))  # every repeat's pages stay in its memory
    (work / "store").mkdir(exist_ok=True)
    store = StoreProcess(work / "store", "--host-capacity", capacity, "--auth-tokens", str(tokens))
    with store if "kvstore-serve" in args.setups else contextlib.nullcontext(None) as serving:
        report = run_child(args, work, setup_specs(args, serving, token_file))
    rows = rows_of(report, args.pages)
    title = (
        f"SGLang {report['sglang']} HiCache storage: medians of the {args.repeats} repeats, those with every page back"
    )
    print_rows(title, rows)
    print_details(report, args.pages)
    write_json(args.json, rows)
    problems = check(report, args.pages)
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    return command(_args(argv))


def command(args: argparse.Namespace) -> int:
    """The whole bench for parsed ``args`` (``main``, or ``kvstore bench sglang-hicache``)."""
    if not args.sglang_python.exists():
        print(f"error: no SGLang environment ({args.sglang_python} is missing): run `make sglang`", file=sys.stderr)
        return 2
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        return run(args, args.work)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-sglang-hicache-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
