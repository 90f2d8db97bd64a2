"""benchmarks/link_overlap_probe.py (whether host copies overlap each other and compute on a GPU) runs before a
GPU is lent: on the CPU's host memory kinds it times every program and derives the ratios it prints."""

import pytest

from benchmarks import link_overlap_probe


def test_every_program_is_timed_and_the_ratios_follow_from_the_times():
    r = link_overlap_probe.probe(gib=1 / 1024, repeats=1, matmul_dim=32, matmul_count=2)
    s = r["seconds"]
    assert set(s) == {"h2d", "d2h", "both", "matmuls", "matmuls+h2d", "matmuls+d2h"}
    assert all(t > 0 for t in s.values())
    assert r["bytes"] == 2**20
    assert r["both_over_sum"] == pytest.approx(s["both"] / (s["h2d"] + s["d2h"]))
    assert r["matmuls_d2h_over_sum"] == pytest.approx(s["matmuls+d2h"] / (s["matmuls"] + s["d2h"]))
    assert 0.5 <= r["h2d_hidden_bound"] < 1.0
    assert "both / (h2d + d2h)" in link_overlap_probe.summary(r)


def test_a_size_that_is_not_positive_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["link_overlap_probe.py", "--gib", "0"])
    with pytest.raises(SystemExit):
        link_overlap_probe.main()
    assert "must be positive" in capsys.readouterr().err


def test_the_streamed_update_is_timed_with_its_state_on_host_and_in_hbm():
    """The project's own streamed update beside the same update in HBM: both timed, the state's bytes
    counted (float32 master and two moments a parameter), and the line the probe prints names the rate."""
    u = link_overlap_probe.streamed_update(layers=2, dim=64, repeats=1)
    assert set(u["seconds"]) == {"device", "host"} and all(t > 0 for t in u["seconds"].values())
    assert u["state_bytes"] == 2 * 64 * 64 * 12
    assert u["both_ways_bytes_per_s"] > 0
    r = link_overlap_probe.probe(gib=1 / 1024, repeats=1, matmul_dim=32, matmul_count=2)
    assert "streamed update (2 x 64^2" in link_overlap_probe.summary({**r, "streamed": u})


def test_the_row_loops_are_timed_under_both_settings():
    """The row loops (a host row in and one out per iteration, with and without a matmul, in the memcpy
    and the kernel form): every program timed under the step's settings and the two command-buffer ones, each
    call threading the donated stacks into the next, and the line names both ratios."""
    u = link_overlap_probe.row_loops(rows=3, row_mib=1 / 64, repeats=2, matmul_dim=16)
    assert set(u["seconds"]) == {"step settings", "command buffers concurrent", "memcpys outside command buffers",
                                 "command buffers off"}
    for times in u["seconds"].values():
        assert set(times) == {"rows h2d", "rows d2h", "rows both", "rows matmuls", "rows both+matmuls",
                              "rows both (kernels)", "rows both+matmuls (kernels)"}
        assert all(t > 0 for t in times.values())
    assert u["row_bytes"] == 2**20 // 64
    r = link_overlap_probe.probe(gib=1 / 1024, repeats=1, matmul_dim=32, matmul_count=2)
    line = link_overlap_probe.summary({**r, "row_loops": u})
    assert "row loops (3 rows of 0.0156 MiB" in line and "command buffers off:" in line
    assert "both+matmuls / sum" in line
