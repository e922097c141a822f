"""The runner of the session's background worlds (tests/background.py): a world built there is what its fixture
gets, unpickled from the runner's folder; one that failed there is built again in the fixture's own process, so
its error is raised where the fixture asks for it, as if there were no runner; one the runner was not handed is
built in place."""

from __future__ import annotations

import pytest
from background import JOBS, Background

from eagle3nb.errors import InputError
from eagle3nb.toy import shipped


def test_a_world_is_built_in_the_background_and_a_failed_one_again_in_the_fixtures_process(tmp_path, monkeypatch):
    monkeypatch.setitem(JOBS, "a_toy", ("toy", {"spec": "toy:smoke"}))
    monkeypatch.setitem(JOBS, "no_toy", ("toy", {"spec": "toy:nope"}))
    monkeypatch.setitem(JOBS, "not_handed", ("toy", {"spec": "toy:smoke"}))
    runner = Background(tmp_path / "runner", ["a_toy", "no_toy"])
    try:
        assert runner.result("a_toy", tmp_path / "here") == shipped("smoke")
        assert (tmp_path / "runner" / "a_toy.pkl").is_file()  # the value came from the runner
        with pytest.raises(InputError, match="unknown toy size 'toy:nope'"):
            runner.result("no_toy", tmp_path / "here")
        assert "InputError: unknown toy size 'toy:nope'" in (tmp_path / "runner" / "no_toy.failed").read_text()
        assert runner.result("not_handed", tmp_path / "here") == shipped("smoke")
        assert not (tmp_path / "runner" / "not_handed.pkl").exists()
        assert runner.proc.wait(timeout=60) == 0  # done with its jobs, failed ones included
    finally:
        runner.close()
