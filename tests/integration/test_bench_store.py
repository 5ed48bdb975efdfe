"""``kvstore bench store`` end to end with small settings: it starts its own store, the
plain grpcio peer and client processes, and writes every row with a limit and a ratio, for
every path (shm, a sealed tenant's pool, the TCP data channel, gRPC streams; no speed
assertions: this machine is shared and noisy)."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_store_writes_rows_with_limits(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "kvstore",
        "bench",
        "store",
        "--repeat",
        "1",
        "--json",
        str(out),
        "--sizes",
        "1MiB",
        "--clients",
        "1,2",
        "--client-size",
        "1MiB",
        "--client-objects",
        "2",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = [r["name"] for r in rows]
    assert names == [
        "lookup 512 keys (1 RPC)",
        "shm get 1 MiB",
        "shm get 1 MiB round trips",
        "shm put 1 MiB",
        "shm get 1 MiB, sealed pool",
        "tcp get 1 MiB vs TCP",
        "tcp get 1 MiB vs grpc",
        "tcp put 1 MiB vs TCP",
        "tcp put 1 MiB vs grpc",
        "grpc-stream get 1 MiB vs TCP",
        "grpc-stream get 1 MiB vs grpc",
        "grpc-stream put 1 MiB vs TCP",
        "grpc-stream put 1 MiB vs grpc",
        "1 client shm get 1 MiB",
        "2 clients shm get 1 MiB aggregate",
        "2 clients get p50",
        "2 clients get p99",
    ]
    for row in rows:
        assert row["value"] > 0 and row["limit_value"] > 0 and row["limit_name"], row
        assert math.isclose(row["ratio"], row["value"] / row["limit_value"], rel_tol=1e-3, abs_tol=1e-4), row
        assert row["unit"] in ("ms", "GB/s", "RPCs") and row["better"] in ("higher", "lower"), row
    lookup = rows[0]
    assert (lookup["unit"], lookup["better"], lookup["target"]) == ("ms", "lower", 2.0)
    # the one 1 MiB target: a get over the data channel at least as fast as plain grpc
    assert {r["name"]: r["target"] for r in rows[1:] if r["target"] is not None} == {
        "tcp get 1 MiB vs grpc": 1.0,
        "shm get 1 MiB round trips": 1.0,
    }
    trips = next(r for r in rows if r["name"] == "shm get 1 MiB round trips")
    assert trips["value"] == 1.0  # a same-host read waits for its Get only
    assert "kvstore bench store" in done.stdout and "lookup 512 keys" in done.stdout
