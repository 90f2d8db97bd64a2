"""benchmarks/moe_layer_speed.py (the GPU side of the MoE dispatch measurements) runs before a GPU is lent:
a CPU-sized layer gives a row per dispatch and the dense MLP, with times and the ratios the table prints."""

import pytest

from benchmarks import moe_layer_speed


def test_every_dispatch_and_the_dense_mlp_are_timed_on_a_small_layer():
    result = moe_layer_speed.measure(["--d-model", "32", "--experts", "5", "--top-k", "2", "--expert-hidden", "16",
                                      "--tokens", "64", "--seq-len", "32", "--repeats", "2"])
    assert result["tokens"] == 64 and result["backend"] == "cpu"
    assert list(result["rows"]) == ["dropless", "dropless_blocked", "capacity", "dense_mlp_32"]
    for row in result["rows"].values():
        assert row["seconds"] > 0 and row["tokens_per_s"] == pytest.approx(64 / row["seconds"])
    dense = result["rows"]["dense_mlp_32"]
    assert dense["vs_dense"] == 1.0
    # The same active FLOPs by construction: top-2 x 16 hidden is the dense MLP's 32 (the router's added).
    assert result["rows"]["dropless"]["active_forward_flops"] >= dense["active_forward_flops"]
    table = moe_layer_speed.render(result)
    assert "dropless_blocked" in table and "vs dense" in table


def test_an_unknown_dispatch_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        moe_layer_speed.measure(["--dispatches", "dropless,sorted"])
    assert "unknown dispatch(es) ['sorted']" in capsys.readouterr().err
