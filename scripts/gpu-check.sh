#!/usr/bin/env bash
# GPU checks for the connector's copy path (DESIGN §8, §11).  Run on a machine with a CUDA GPU:
#   scripts/gpu-check.sh          # set up .venv, run the gpu tests, then the copy benchmark
#   GPU_CHECK_INSTALL=0 scripts/gpu-check.sh   # use .venv as it is (offline machines)
# Each benchmark figure is printed beside the plain tensor.copy_ limit measured in the same run.
# Exits non-zero when any step fails, including when torch in .venv cannot see a GPU.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=.venv/bin/python

echo "== setup"
if [[ ! -x $PY ]]; then
    python3 -m venv .venv
fi
if [[ ${GPU_CHECK_INSTALL:-1} == 1 ]]; then
    "$PY" -m pip install -q -e '.[test]'
    "$PY" -m pip install -q cupy-cuda12x || echo "cupy-cuda12x not installed (optional)"
fi

echo "== devices"
nvidia-smi -L
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} in .venv cannot see a GPU (a CPU-only build?)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== gpu tests"
"$PY" -m pytest -q -m gpu tests/gpu

echo "== copy bandwidth"
"$PY" - <<'PY'
"""H2D/D2H of 32 MiB and a 32-layer chunk's gather/scatter, each beside the plain copy_ limit."""
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    print("no CUDA")
    sys.exit(2)

from connector.device import CudaDevice
from connector.transfer import PagedKV
from kvstore.codec import HEADER_SIZE

REPS = 20
MiB = 1 << 20


def median_s(fn):
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(name, nbytes, seconds, limit_seconds):
    gbs, limit = nbytes / seconds / 1e9, nbytes / limit_seconds / 1e9
    print(f"{name:<34} {gbs:7.1f} GB/s   limit (plain copy_) {limit:7.1f} GB/s   "
          f"ratio {gbs / limit:5.2f}")


nbytes = 32 * MiB
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
device = CudaDevice()  # the connector's copy path: side stream + event, vs plain copy_
h2d_limit = median_s(lambda: dev.copy_(host, non_blocking=True))
d2h_limit = median_s(lambda: host.copy_(dev, non_blocking=True))
h2d = median_s(lambda: device.submit(lambda: dev.copy_(host, non_blocking=True)).wait())
d2h = median_s(lambda: device.submit(lambda: host.copy_(dev, non_blocking=True)).wait())
report("H2D 32 MiB pinned -> device", nbytes, h2d, h2d_limit)
report("D2H 32 MiB device -> pinned", nbytes, d2h, d2h_limit)

# A 32-layer chunk of 16 blocks, flash-attention layout [2, blocks, 16, 8, 128] bf16: 32 MiB.
layers, blocks, chunk = 32, 256, 16
shape = (layers, 2, blocks, 16, 8, 128)
kv_buf = torch.randn(shape, device="cuda").to(torch.bfloat16)
names = [f"layer.{i}" for i in range(layers)]
paged = PagedKV({n: kv_buf[i] for i, n in enumerate(names)}, names, blocks)
payload_bytes = layers * chunk * paged.layout.page_bytes
pool = torch.empty(HEADER_SIZE + payload_bytes, dtype=torch.uint8, pin_memory=True)
payload = paged.payload_view(pool, 0, chunk)
block_ids = list(range(0, 2 * chunk, 2))  # scattered blocks, as in a real block table
flat = torch.empty(payload_bytes, dtype=torch.uint8, device="cuda")
pool_payload = pool[HEADER_SIZE:]
copy_d2h = median_s(lambda: pool_payload.copy_(flat, non_blocking=True))
copy_h2d = median_s(lambda: flat.copy_(pool_payload, non_blocking=True))

gather = median_s(lambda: device.submit(lambda: paged.gather(block_ids, payload)).wait())
scatter = median_s(lambda: device.submit(
    lambda: [paged.scatter_layer(i, block_ids, payload) for i in range(layers)]).wait())
device.close()
report(f"gather {layers}-layer chunk ({payload_bytes // MiB} MiB)", payload_bytes, gather, copy_d2h)
report(f"scatter {layers}-layer chunk ({payload_bytes // MiB} MiB)", payload_bytes, scatter, copy_h2d)
PY
echo "== gpu-check passed"
