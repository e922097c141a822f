"""``eagle3nb plan``: servers, GPU-hours and disk for N samples, per data source, and which is the wall. Every
expected number is computed here from the inputs."""

from __future__ import annotations

import json
import math

import pytest

from eagle3nb.cli import main
from eagle3nb.errors import InputError
from eagle3nb.sizing import plan_run

N, T, TPS, BPT, GPUS = 1_000_000, 1444, 3165.0, 57_349, 8


def test_figures_follow_from_the_inputs():
    epochs, held, evals, deadline, servers = 3, 0.05, 4, 24.0, 10
    p = plan_run(N, T, TPS, BPT, free_disk_bytes=1e15, servers=servers, deadline_h=deadline, epochs=epochs,
                 holdout_fraction=held, evaluations=evals, gpus_per_server=GPUS)
    tokens = N * T
    online = epochs * tokens * (1 - held) + evals * tokens * held
    expect = {"stored": (tokens, tokens * BPT), "online": (online, 0), "hybrid": (tokens, tokens * BPT)}
    for name, (target, disk) in expect.items():
        f = p["sources"][name]
        hours = target / TPS / 3600
        assert f["target_tokens"] == pytest.approx(target)
        assert f["disk_bytes"] == pytest.approx(disk)
        assert f["server_hours"] == pytest.approx(hours)
        assert f["gpu_hours"] == pytest.approx(hours * GPUS)
        assert f["wall_h"] == pytest.approx(hours / servers)
        assert f["servers_needed"] == math.ceil(hours / deadline)
    assert p["tokens"] == tokens


def test_the_wall_is_the_disk_when_the_states_do_not_fit():
    tokens = N * T
    hours = tokens / TPS / 3600
    servers = math.ceil(hours / 48)  # exactly enough servers for stored to meet 48 h
    p = plan_run(N, T, TPS, BPT, free_disk_bytes=tokens * BPT / 2, servers=servers, deadline_h=48, epochs=1,
                 holdout_fraction=0.0, evaluations=0)
    assert p["sources"]["stored"]["wall"] == "disk" and p["sources"]["hybrid"]["wall"] == "disk"
    assert not p["sources"]["stored"]["fits_disk"] and p["sources"]["stored"]["meets_deadline"]
    assert p["sources"]["online"]["wall"] is None  # 1 epoch, nothing held out: stored's target work, no disk


def test_the_wall_is_the_servers_when_too_few():
    tokens = N * T
    hours = tokens / TPS / 3600
    need = math.ceil(hours / 24)
    p = plan_run(N, T, TPS, BPT, free_disk_bytes=tokens * BPT * 2, servers=need - 1, deadline_h=24)
    stored = p["sources"]["stored"]
    assert stored["servers_needed"] == need and stored["wall"] == "servers" and stored["fits_disk"]
    assert p["sources"]["online"]["wall"] == "servers"  # 2 epochs: more target work still
    both = plan_run(N, T, TPS, BPT, free_disk_bytes=1.0, servers=1, deadline_h=24)
    assert both["sources"]["stored"]["wall"] == "disk and servers"


def test_bad_inputs_are_refused():
    with pytest.raises(InputError):
        plan_run(0, T, TPS, BPT, 1e12, 1, 24)
    with pytest.raises(InputError):
        plan_run(N, T, TPS, BPT, 1e12, 1, 24, holdout_fraction=1.0)


def test_the_command_line(tmp_path, capsys):
    argv = ["plan", "--samples", "1000000", "--tokens-per-sample", "1444", "--tokens-per-s", "3165",
            "--bytes-per-token", "57349", "--free-disk-gb", "40000", "--servers", "4", "--deadline-h", "48"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| stored |" in out and "| online |" in out and "disk" in out
    (tmp_path / "metrics.json").write_text(json.dumps({"tokens_per_s": TPS, "bytes_per_token": BPT}))
    argv = ["plan", "--samples", "1000", "--tokens-per-sample", "100", "--metrics", str(tmp_path),
            "--free-disk-gb", "1", "--deadline-h", "1", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens_per_s"] == TPS and got["sources"]["stored"]["disk_bytes"] == pytest.approx(1000 * 100 * BPT)
    no_rate = ["plan", "--samples", "10", "--tokens-per-sample", "5", "--free-disk-gb", "1", "--deadline-h", "1"]
    assert main(no_rate) == 2  # neither --tokens-per-s nor --metrics: one line, exit 2
