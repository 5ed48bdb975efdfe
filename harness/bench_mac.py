"""``kvstore bench mac``: what the keyed MACs cost the main job's hits, MACs on beside off.

Runs on the host and never imports vLLM.  The main job of ``make run`` (``harness.main``:
the standard prefix-sharing workload on the tiny float32 model, engine 1 saving to an
empty SSD directory and hitting host DRAM, then engine 2, a new process, hitting what
engine 1 left on SSD) runs ``--rounds`` times with the connector's ``mac_objects`` on and
``--rounds`` times with it off, interleaved (on/off, then off/on, ...), each pass on a
fresh SSD directory.  A pass with MACs off writes and reads unsealed objects: it is the
limit a MAC can at best reach.

Per pass it takes the TTFT p50 of each engine's hits (the requests the connector's own log
says it served), and prints the median over the rounds of each, MACs on beside off, with
the target of the trust issue: hit TTFT within 5% (ratio <= 1.05).  Engine 2's hits pay
one MAC check per object as it enters the host pool; engine 1's hits come from objects it
sealed at commit.  Every pass's outputs are compared with a no-connector reference run
(greedy tokens and logprobs); the exit status is 1 if any pass mismatched or engine 2 hit
nothing on SSD.
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


@dataclass(frozen=True)
class Pass:
    """One main-job pass: each engine's hit TTFT p50 (s), and whether it checked out."""

    mac: bool
    hit_p50: tuple[float, float]
    ok: bool


def interleaved(rounds: int) -> list[bool]:
    """The MAC setting of each pass: on/off, then off/on, and so on (so neither setting
    always runs first, on a machine whose load drifts)."""
    order: list[bool] = []
    for r in range(rounds):
        order += [True, False] if r % 2 == 0 else [False, True]
    return order


def run_pass(
    model: Path, workload: kit.Workload, reference: kit.EngineResult, work: Path, mac: bool, timeout: float
) -> Pass:
    """Engines 1 and 2 of the main job on a fresh SSD directory under ``work``."""
    p50s, ok = [], True
    for i in (1, 2):
        stats_path = work / f"stats-{i}.json"
        result = kit.run_engine(
            model, connector_config(work / "ssd", stats_path, mac_objects=mac), workload, timeout_s=timeout
        )
        stats = json.loads(stats_path.read_text())
        hits = kit.summarize(result.requests, hit_labels(result, stats)).hits
        ok = ok and bool(kit.compare_outputs(reference, result)) and hits.p50 is not None
        if i == 2:
            ok = ok and bool(lower_hit_tokens(stats))
        p50s.append(hits.p50 if hits.p50 is not None else float("nan"))
    return Pass(mac, (p50s[0], p50s[1]), ok)


def rows(passes: list[Pass]) -> list[Row]:
    """Per engine: the median over the rounds of the hit TTFT p50, MACs on beside off."""
    out = []
    for i, name in enumerate(ENGINES):
        on = statistics.median(p.hit_p50[i] for p in passes if p.mac) * 1e3
        off = statistics.median(p.hit_p50[i] for p in passes if not p.mac) * 1e3
        out.append(Row(name, on, "ms", "the same, MACs off", off, better="lower", target=TARGET))
    return out


def run(args) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-bench-mac-"))
    model = tinymodel.build_named(Path(args.model_dir or work / "model"), "tiny-f32")
    workload = kit.Workload.standard(vocab=tinymodel.GEOMETRIES["tiny-f32"].vocab)
    reference = kit.run_engine(model, None, workload, timeout_s=args.timeout)
    passes = []
    for n, mac in enumerate(interleaved(args.rounds)):
        p = run_pass(model, workload, reference, work / f"pass-{n}-{'on' if mac else 'off'}", mac, args.timeout)
        passes.append(p)
        print(
            f"pass {n + 1} MACs {'on ' if mac else 'off'}: hit TTFT p50 engine 1 {p.hit_p50[0] * 1e3:.1f} ms, "
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

    p = suites.add_parser("mac", help="the main job's hit TTFT with MACs on beside off, interleaved")
    p.add_argument("--rounds", type=positive, default=5, help="passes with MACs on, and as many off")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--model-dir", help="where the tiny model is built (reused when present)")
    p.add_argument("--workdir", help="keep SSD files and stats here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine run")
    p.set_defaults(func=run)
