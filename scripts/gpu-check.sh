#!/usr/bin/env bash
# GPU checks for the connector's copy path (docs/architecture.md#copy-engines), as one script under 5 minutes.
#
#   scripts/gpu-check.sh                      # on a machine with a CUDA GPU
#   GPU_CHECK_PYTHON=/path/python scripts/gpu-check.sh
#
# It installs nothing from a package index (the lent GPU machine reaches none).  Python is
# GPU_CHECK_PYTHON, else .venv/bin/python when its torch sees a GPU, else python3.  Wheels
# of missing pure dependencies may be carried in .whl/ (see the device tool's README): they
# are installed offline into /tmp/kvstore-site.  What cannot run is said, step by step.
#
# Steps: the devices; the gpu-marked tests (CudaDevice, PagedKV on cuda:0, and WorkerHalf
# end to end on an HND paged KV with the pinned shared host pool: saves released without
# preemption, sealed objects verify, loads reach CONSUMABLE, a stream failure becomes
# failed blocks); then H2D/D2H of a 32 MiB chunk through the connector's path beside a
# plain pinned cudaMemcpy (tensor.copy_) measured in the same run.
# Exit status: 0 when every step ran and passed; 1 when a step failed; 2 when a step could
# not run (no GPU, or a missing package).
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
could_not() { echo "!! could not run: $*"; [[ $status == 0 ]] && status=2; }
failed() { echo "!! FAILED: $*"; status=1; }

echo "== python"
pick_python() {
    for py in "${GPU_CHECK_PYTHON:-}" .venv/bin/python python3; do
        [[ -n $py ]] && command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}
if ! PY=$(pick_python); then
    nvidia-smi -L 2>&1 || true
    could_not "no Python here has a torch that sees a CUDA GPU (tried ${GPU_CHECK_PYTHON:-} .venv/bin/python python3)"
    exit $status
fi
echo "using $PY"

if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== offline wheels from .whl/"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/kvstore-site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/kvstore-site"
    else
        echo "   (installing .whl/ failed; going on with what is installed)"
    fi
fi

echo "== devices"
nvidia-smi -L 2>&1 || echo "   (nvidia-smi not available)"
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'

echo "== imports"
missing=$("$PY" - <<'PY'
import importlib
out = []
for name in ("numpy", "xxhash", "lz4.block", "pytest", "yaml"):
    try:
        importlib.import_module(name)
    except ImportError:
        out.append(name.split(".")[0])
print(" ".join(out))
PY
)
if [[ -n ${missing// } ]]; then
    could_not "python packages missing: $missing (carry their wheels in .whl/: pip download --no-deps" \
              "--only-binary=:all: --python-version 3.12 ... -d .whl NAME)"
    exit $status
fi
echo "   numpy, xxhash, lz4, pytest, yaml: present"

echo "== gpu tests (tests/gpu, marker gpu)"
if ! timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/gpu; then
    failed "gpu tests"
fi

echo "== copy bandwidth: 32 MiB chunk, connector path vs plain pinned cudaMemcpy (same run)"
if ! timeout 90 "$PY" - <<'PY'
"""H2D/D2H of a 32 MiB chunk: CudaDevice + PagedKV on the pinned shared host pool, beside a
plain copy_ between a torch-pinned tensor and the GPU (cudaMemcpyAsync), same run."""
import statistics
import time

import torch

from connector.device import CudaDevice
from connector.transfer import PagedKV
from kvstore.codec import HEADER_SIZE
from tiers.host_shm import create_shared

REPS, MiB = 20, 1 << 20


def median_s(fn):
    fn()
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
    print(f"{name:<44} {gbs:7.1f} GB/s   limit (pinned cudaMemcpy) {limit:7.1f} GB/s   ratio {gbs / limit:5.2f}")


# A 32-layer chunk of 16 blocks in the HND layout [2, blocks, 8 heads, 16, 128] bf16: 32 MiB.
layers, blocks, chunk = 32, 256, 16
kv_buf = torch.randn((layers, 2, blocks, 8, 16, 128), device="cuda").to(torch.bfloat16)
names = [f"layer.{i}" for i in range(layers)]
paged = PagedKV({n: kv_buf[i] for i, n in enumerate(names)}, names, blocks)
nbytes = layers * chunk * paged.layout.page_bytes
assert nbytes == 32 * MiB, nbytes

pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
h2d_limit = median_s(lambda: flat.copy_(pinned, non_blocking=True))
d2h_limit = median_s(lambda: pinned.copy_(flat, non_blocking=True))

pool = create_shared(HEADER_SIZE + nbytes + (1 << 20), pin=True)  # the shared host pool, pinned
try:
    pool_t = torch.from_numpy(pool.array)
    payload = paged.payload_view(pool_t, 0, chunk)
    runs = list(range(0, chunk))                 # consecutive blocks: one slice per layer
    scattered = list(range(0, 2 * chunk, 2))     # every other block: an index gather
    device = CudaDevice()
    for label, ids in (("consecutive", runs), ("scattered", scattered)):
        d2h = median_s(lambda: device.submit(lambda: paged.gather(ids, payload)).wait())
        h2d = median_s(lambda: device.submit(
            lambda: [paged.scatter_layer(i, ids, payload) for i in range(layers)]).wait())
        report(f"D2H save gather, {label} blocks", nbytes, d2h, d2h_limit)
        report(f"H2D load scatter, {label} blocks", nbytes, h2d, h2d_limit)
    device.close()
    del payload, pool_t
finally:
    pool.close()
PY
then
    failed "copy bandwidth"
fi

case $status in
    0) echo "== gpu-check passed" ;;
    1) echo "== gpu-check FAILED" ;;
    *) echo "== gpu-check incomplete: some steps could not run (see '!! could not run')" ;;
esac
exit $status
