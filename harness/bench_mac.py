"""``kvstore bench mac``: what keyed MACs and encryption at rest cost the main job's hits.

Runs on the host and never imports vLLM.  The main job of ``make run`` (``harness.main``:
the standard prefix-sharing workload on the tiny float32 model, engine 1 saving to an
empty SSD directory and hitting host DRAM, then engine 2, a new process, hitting what
engine 1 left on SSD) runs ``--rounds`` times in each of three settings, interleaved (the
order rotates every round), each pass on a fresh SSD directory: ``mac`` (the default: the
connector's ``mac_objects`` on), ``off`` (``mac_objects`` off: unsealed objects, the limit
a MAC can at best reach) and ``encrypted`` (``encrypt_at_rest``: AES-256-GCM on SSD).

Per pass it takes the TTFT p50 of each engine's hits (the requests the connector's own log
says it served), and prints the median over the rounds of each, MACs on and encrypted each
beside off, with the trust issue's target for MACs: hit TTFT within 5% (ratio <= 1.05).
Engine 2's hits pay one MAC check (or one decryption) per object as it enters the host
pool; engine 1's hits come from objects it sealed at commit.  Every pass's outputs are
compared with a no-connector reference run (greedy tokens and logprobs); the exit status is
1 if any pass mismatched or engine 2 hit nothing on SSD.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness import kit, tinymodel
from harness.main import connector_config, hit_labels, lower_hit_tokens
from kvstore.bench.common import Row, print_rows, write_json

TARGET = 1.05  # hit TTFT with MACs on within 5% of off
ENGINES = ("engine 1 hits (host DRAM)", "engine 2 hits (from SSD)")
SETTINGS = {"mac": {}, "off": {"mac_objects": False}, "encrypted": {"encrypt_at_rest": True}}


@dataclass(frozen=True)
class Pass:
    """One main-job pass: each engine's hit TTFT p50 (s), and whether it checked out."""

    setting: str
    hit_p50: tuple[float, float]
    ok: bool


def interleaved(rounds: int) -> list[str]:
    """The setting of each pass: the order of ``SETTINGS`` rotates every round (so no
    setting always runs first, on a machine whose load drifts)."""
    names = list(SETTINGS)
    return [names[(r + i) % len(names)] for r in range(rounds) for i in range(len(names))]


def run_pass(
    model: Path, workload: kit.Workload, reference: kit.EngineResult, work: Path, setting: str, timeout: float
) -> Pass:
    """Engines 1 and 2 of the main job on a fresh SSD directory under ``work``."""
    p50s, ok = [], True
    for i in (1, 2):
        stats_path = work / f"stats-{i}.json"
        result = kit.run_engine(
            model, connector_config(work / "ssd", stats_path, **SETTINGS[setting]), workload, timeout_s=timeout
        )
        stats = json.loads(stats_path.read_text())
        hits = kit.summarize(result.requests, hit_labels(result, stats)).hits
        ok = ok and bool(kit.compare_outputs(reference, result)) and hits.p50 is not None
        if i == 2:
            ok = ok and bool(lower_hit_tokens(stats))
        p50s.append(hits.p50 if hits.p50 is not None else float("nan"))
    return Pass(setting, (p50s[0], p50s[1]), ok)


def rows(passes: list[Pass]) -> list[Row]:
    """Per engine: the median over the rounds of the hit TTFT p50, MACs on and encrypted
    each beside off."""

    def median_ms(setting: str, i: int) -> float:
        return statistics.median(p.hit_p50[i] for p in passes if p.setting == setting) * 1e3

    out = []
    for i, name in enumerate(ENGINES):
        off = median_ms("off", i)
        out.append(Row(f"{name}, MACs", median_ms("mac", i), "ms", "the same, MACs off", off, "lower", TARGET))
        out.append(Row(f"{name}, encrypted", median_ms("encrypted", i), "ms", "the same, MACs off", off, "lower"))
    return out


def run(args) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-bench-mac-"))
    model = tinymodel.build_named(Path(args.model_dir or work / "model"), "tiny-f32")
    workload = kit.Workload.standard(vocab=tinymodel.GEOMETRIES["tiny-f32"].vocab)
    reference = kit.run_engine(model, None, workload, timeout_s=args.timeout)
    passes = []
    for n, setting in enumerate(interleaved(args.rounds)):
        p = run_pass(model, workload, reference, work / f"pass-{n}-{setting}", setting, args.timeout)
        passes.append(p)
        print(
            f"pass {n + 1} {setting:<9}: hit TTFT p50 engine 1 {p.hit_p50[0] * 1e3:.1f} ms, "
            f"engine 2 {p.hit_p50[1] * 1e3:.1f} ms; {'outputs match, SSD hits' if p.ok else 'CHECK FAILED'}",
            flush=True,
        )
    table = rows(passes)
    print_rows(f"hit TTFT of the main job, median of {args.rounds} passes each, interleaved (lower is better)", table)
    write_json(args.json, table)
    return 0 if all(p.ok for p in passes) else 1


def register(suites) -> None:
    """``kvstore bench mac`` (a ``kvstore.bench`` entry point)."""
    from kvstore.cli.bench import positive

    p = suites.add_parser("mac", help="the main job's hit TTFT with MACs, without, and encrypted, interleaved")
    p.add_argument("--rounds", type=positive, default=5, help="passes in each setting (mac, off, encrypted)")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--model-dir", help="where the tiny model is built (reused when present)")
    p.add_argument("--workdir", help="keep SSD files and stats here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    p.set_defaults(func=run)
