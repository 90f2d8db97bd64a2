"""Where the planner's host update rate comes from: flag, the benchmark's JSON file, or the default."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spillway.recipes.plan import host_update

REPO = Path(__file__).resolve().parents[3]


def test_flag_beats_file_beats_default(tmp_path, monkeypatch):
    monkeypatch.setenv(host_update.RATE_FILE_ENV, str(tmp_path / "rate.json"))
    assert host_update.host_update_rate() == (host_update.DEFAULT_PARAMS_PER_S_PER_CORE,
                                              "default (benchmarks/host_update_rate.py not run on this machine)")
    (tmp_path / "rate.json").write_text(json.dumps({"params_per_s_per_core": 1.5e8}))
    assert host_update.host_update_rate() == (1.5e8, str(tmp_path / "rate.json"))
    assert host_update.host_update_rate(2e7) == (2e7, "--host-update-rate")


@pytest.mark.parametrize("text,message", [("{}", "not a host update rate"), ("nonsense", "not a host update rate"),
                                          ('{"params_per_s_per_core": -1}', "must be a positive finite number")])
def test_a_bad_rate_file_names_itself(tmp_path, monkeypatch, text, message):
    path = tmp_path / "rate.json"
    path.write_text(text)
    monkeypatch.setenv(host_update.RATE_FILE_ENV, str(path))
    with pytest.raises(ValueError, match=message) as error:
        host_update.host_update_rate()
    assert str(path) in str(error.value)


@pytest.mark.parametrize("rate", [0, float("inf"), float("nan")])
def test_a_flag_that_is_not_a_positive_finite_rate_is_refused(rate):
    """inf was accepted, and every host-CPU update priced as taking no time."""
    with pytest.raises(ValueError, match="--host-update-rate must be a positive finite number"):
        host_update.host_update_rate(rate)


@pytest.mark.parametrize("cores", [0, float("inf")])
def test_host_cores_that_are_not_a_positive_finite_count_are_refused(cores):
    from spillway.recipes.plan.planner import _host_pricing

    with pytest.raises(ValueError, match="--host-cores must be a positive finite number"):
        _host_pricing(None, cores)


def test_benchmark_writes_a_file_the_planner_reads(tmp_path, monkeypatch):
    out = tmp_path / "measured.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_update_rate.py"), "--layers", "2",
                    "--d-model", "64", "--d-ff", "128", "--steps", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    measured = json.loads(out.read_text())
    assert measured["params"] == 2 * 64 * 128 and measured["params_per_s_per_core"] > 0
    monkeypatch.setenv(host_update.RATE_FILE_ENV, str(out))
    assert host_update.host_update_rate()[0] == measured["params_per_s_per_core"]
