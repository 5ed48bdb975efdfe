"""The house stays readable: no hand-written source file of the packages an engine loads
(``kvstore``, ``tiers``, ``connector``, ``adapters``) runs past 400 lines, and ``kvstore/``
keeps at most 12 top-level modules (docs/architecture.md).  Generated protobuf code aside.
Reads files only: well under a second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstore", "tiers", "connector", "adapters")
MAX_LINES = 400
MAX_TOP_LEVEL = 12


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_proto" not in p.parts]


def test_no_source_file_runs_past_400_lines():
    sources = _sources()
    assert len(sources) > 100  # the walk found the packages
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these files (over {MAX_LINES} lines): {long}"


def test_kvstore_has_at_most_12_top_level_modules():
    modules = sorted(p.stem for p in (ROOT / "kvstore").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert 0 < len(modules) <= MAX_TOP_LEVEL, modules
