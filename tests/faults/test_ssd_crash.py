"""Crash the SSD tier's writer with SIGKILL mid-write; a re-open must serve only whole objects.

A real writer process puts 8 MiB objects in a loop (in 1 MiB writes) and prints each key once
``put_commit`` returned True (fsynced and renamed).  We kill it after a few commits at
varying delays, then re-open the directory: every printed key must be present and verify,
every indexed object must verify, the index must equal the files, and no temp file may remain.
(SIGKILL loses the process, not the page cache; power loss is not simulated here.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvstore.codec import verify
from kvstore.keys import ObjectKey
from tiers.ssd import SSDTier

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import asyncio, sys
    from kvstore.codec import HEADER_SIZE, ObjectGeometry, encode_into, object_size
    from kvstore.keys import ROOT, Identity, ObjectKey, chunk_hashes
    from tiers.ssd import SSDTier

    async def main(directory, seed):
        ns = Identity("crash", "r", "bf16", "cpu:test", 4, 2, 64).namespace()
        geometry = ObjectGeometry(8, 4, 256 * 1024)  # 8 MiB payload
        obj = memoryview(bytearray(object_size(geometry)))
        tier, parent = SSDTier(directory, 1 << 40), ROOT
        for i in range(10_000):
            chunk = chunk_hashes(ns, [seed, i], chunk_size=2, parent=parent)[0]
            key = ObjectKey(ns, chunk)
            obj[HEADER_SIZE:HEADER_SIZE + 8] = i.to_bytes(8, "little")
            obj[-8:] = seed.to_bytes(8, "little")
            encode_into(obj, key, geometry, parent=parent)
            handle = await tier.put_start(key, len(obj))
            for off in range(0, len(obj), 1 << 20):
                await tier.put_write(handle, off, obj[off:off + (1 << 20)])
            if await tier.put_commit(handle):
                print(key.printable(), flush=True)
            parent = chunk

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def run_and_kill(script: Path, directory: Path, seed: int, commits: int, delay: float) -> list[str]:
    """Start the writer, SIGKILL it ``delay`` s after its ``commits``-th commit; keys it printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory), str(seed)], stdout=subprocess.PIPE, text=True, env=env
    )
    printed: list[str] = []
    watchdog = threading.Timer(60, proc.kill)  # a hung writer fails the test instead of hanging it
    watchdog.start()
    try:
        while len(printed) < commits:
            line = proc.stdout.readline()
            assert line, f"writer exited early with {proc.wait()}"
            printed.append(line.strip())
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        rest, _ = proc.communicate(timeout=30)
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL
    return printed + rest.split()  # lines printed before death are committed too


async def check_reopen(directory: Path, committed: list[str]) -> float:
    """Re-open and check every promise; returns the number of torn temp files removed."""
    tier = SSDTier(directory, 1 << 40)
    files = {ObjectKey.parse(p.name[:-3]): p for p in directory.glob("??/*.kv")}
    buf = memoryview(bytearray(16 << 20))
    st = tier.stats()
    assert st.objects == len(files) and st.extra["corrupt_removed"] == 0
    assert list((directory / "tmp").iterdir()) == []
    assert {ObjectKey.parse(k) for k in committed} <= set(files)
    for key, path in files.items():
        size = await tier.read_into(key, buf)
        assert size == path.stat().st_size and verify(buf[:size], key)
    assert tier.stats().hits == len(files) and tier.stats().corrupt == 0
    await tier.aclose()
    return st.extra["torn_removed"]


def test_sigkill_mid_write_never_publishes_a_torn_object(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    directory = tmp_path / "ssd"
    committed: list[str] = []
    torn = 0
    cases = [(2, 0.0), (3, 0.004), (2, 0.011), (4, 0.023), (3, 0.047)]
    for seed, (commits, delay) in enumerate(cases):
        committed += run_and_kill(script, directory, seed, commits, delay)
        torn += asyncio.run(check_reopen(directory, committed))
        print(f"case {seed}: {len(committed)} committed so far, {torn} torn temp files removed")
    assert len(committed) >= sum(c for c, _ in cases)
    assert torn >= 1, "no kill landed mid-write: the test did not exercise a torn put"
