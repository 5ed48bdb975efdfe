"""The main job's options for the docker-compose engine (no engine runs here)."""

import pytest

from harness import kit
from harness.main import main, with_barrier


def test_pause_marks_only_that_request_of_engine_2():
    workload = kit.Workload.standard()
    paused = with_barrier(workload, "doc-1")
    assert [r.label for r in paused.requests if r.barrier] == ["doc-1"]
    assert [r.tokens for r in paused.requests] == [r.tokens for r in workload.requests]
    assert paused.expected_hits == workload.expected_hits


def test_pause_before_an_unknown_request_is_refused():
    with pytest.raises(SystemExit, match="no such request"):
        with_barrier(kit.Workload.standard(), "doc-9")


@pytest.mark.parametrize("args", [["--pause-before", "doc-1"], ["--barrier-dir", "/tmp"]])
def test_pause_and_barrier_dir_go_together(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "go together" in capsys.readouterr().err
