"""benchmarks/update_in_forward.py --time (the stand-in's program shapes timed on a GPU under each command-buffer
setting) runs before a GPU is lent: on the CPU it times every variant under every setting, threading the
donated state from call to call, and the parity shapes' state comes back as (even, odd) pairs."""

import pytest

from benchmarks import update_in_forward


def test_every_timed_variant_runs_under_every_command_buffer_setting():
    args = update_in_forward.parse_args(["--time", "--layers", "4", "--d-model", "32", "--tokens", "16",
                                         "--repeats", "2"])
    assert args.variants == ",".join(update_in_forward.TIMED_VARIANTS)
    result = update_in_forward.time_variants(args)
    assert set(result["rows"]) == set(update_in_forward.TIMED_VARIANTS)
    for times in result["rows"].values():
        assert set(times) == set(update_in_forward.TIMED_SETTINGS)
        assert all(t > 0 for t in times.values())
    assert result["state_bytes"] == 3 * 4 * 32 * 32 * 4


def test_a_repeat_count_below_one_is_one_line(capsys):
    with pytest.raises(SystemExit):
        update_in_forward.parse_args(["--time", "--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
