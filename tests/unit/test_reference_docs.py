"""The reference pages cannot drift from the code: the pages ``connector``, ``store`` and
``metrics`` of ``docs/reference/`` equal what ``harness.docgen`` renders from the typed configs
and the Prometheus collectors now, every key of ``ConnectorConfig`` and ``ServerConfig``
(their ``TierSettings`` and ``LeaseSettings`` included) is a row of its page whose default
reads back as the field's default, and every declared metric is a row of the metrics page.
The README stays a front page (under 250 lines) that links the reference.  The checks are
first shown to fail on altered pages.
Cost: about a second (no engine, no server: the store's collector is built, not served)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from connector.config import ConnectorConfig
from harness import docgen
from kvstore.config import LeaseSettings, TierSettings, convert, field_types
from kvstore.errors import ConfigError
from kvstore.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250


def first_column(text: str) -> list[str]:
    """The backquoted names in the first column of every table row of ``text``."""
    return [m.group(1) for line in text.splitlines() if (m := re.match(r"^\| `([\w:]+)` \|", line))]


def page(name: str) -> str:
    return (docgen.REFERENCE / f"{name}.md").read_text(encoding="utf-8")


# --- the checks can fail ------------------------------------------------------------------------


def test_a_stale_page_is_found(tmp_path):
    for name in docgen.TABLES:
        (tmp_path / f"{name}.md").write_text(page(name).replace("| `lease_ttl` | `30` |", "| `lease_ttl` | `60` |"))
    stale = [path.name for path, (now, fresh) in docgen.rendered(tmp_path).items() if now != fresh]
    assert stale == [f"{name}.md" for name in ("connector", "store")]


def test_a_page_without_markers_is_refused(tmp_path):
    for name in docgen.TABLES:
        (tmp_path / f"{name}.md").write_text(page(name).replace(docgen.END, ""))
    with pytest.raises(ConfigError, match="END generated"):
        docgen.rendered(tmp_path)


def test_a_missing_row_is_found():
    text = page("connector")
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("| `keys_file` |"))
    assert set(first_column(dropped)) != {f.name for f in fields(ConnectorConfig)}


# --- the repository -----------------------------------------------------------------------------


def test_the_reference_pages_are_fresh():
    stale = [str(path.relative_to(ROOT)) for path, (now, fresh) in docgen.rendered().items() if now != fresh]
    assert not stale, f"{stale}: stale; run PYTHONPATH=. python -m harness.docgen"


@pytest.mark.parametrize("name, cls", [("connector", ConnectorConfig), ("store", ServerConfig)])
def test_every_key_is_documented_once(name, cls):
    keys = first_column(page(name))
    assert sorted(keys) == sorted(f.name for f in fields(cls))
    shared = {f.name for f in fields(TierSettings)} | {f.name for f in fields(LeaseSettings)}
    assert shared <= set(keys)


@pytest.mark.parametrize("name, cls", [("connector", ConnectorConfig), ("store", ServerConfig)])
def test_every_documented_default_reads_back_as_the_default(name, cls):
    """The default column as a user would type it converts to the field's default."""
    types, checked = field_types(cls), 0
    for line in page(name).splitlines():
        m = re.match(r"^\| `(\w+)` \| (none|`[^`]*`) \|", line)
        if not m:
            continue
        key, shown = m.groups()
        value = None if shown == "none" else shown.strip("`").replace('""', "")
        default = next(f.default for f in fields(cls) if f.name == key)
        assert (None if value is None else convert(types[key], value, key)) == default, key
        checked += 1
    assert checked == len(fields(cls))


def test_every_metric_is_documented_once():
    declared = [
        docgen.exposed_name(name, kind) for name, kind, _, _ in docgen.connector_metrics() + docgen.store_metrics()
    ]
    assert len(declared) >= 40
    assert sorted(first_column(page("metrics"))) == sorted(declared)


def test_the_readme_is_a_front_page_that_links_the_reference():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < README_MAX_LINES
    for name in docgen.TABLES:
        assert f"docs/reference/{name}.md" in readme, name
