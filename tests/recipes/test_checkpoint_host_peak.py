"""benchmarks/checkpoint_host_peak.py (the GPU suite's checkpoint case) runs before a GPU is lent: CPU-sized."""

import pytest

from benchmarks import checkpoint_host_peak

TINY = ["model.vocab_size=128", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16"]


@pytest.mark.slow   # state creation and a restore compiled: 80 s on 2 loaded cores, each way
@pytest.mark.parametrize("restore_in", ["same process", "a new process"])
def test_the_checkpoint_case_measures_a_save_in_pieces_and_a_restore_beside_the_prediction(restore_in):
    measure = (checkpoint_host_peak.measure if restore_in == "same process"
               else checkpoint_host_peak.measure_in_new_processes)
    row = measure("tiny", TINY, mode="pieces")
    assert row["mode"] == "pieces" and row["state_bytes"] > 0 and row["restored_in"] == restore_in
    assert row["restored_sums_equal"] is True
    # A rise is a difference of two readings of the kernel's resident-set counters, which lag by a few
    # pages (they are batched per thread): a restore that allocates next to nothing new can read -4 KiB
    # (CI, 2026-12-04). A page-sized wobble is noise; a negative MiB would be a broken measurement.
    noise = 1 << 20
    assert row["save_rise_bytes"] >= -noise and row["restore_rise_bytes"] >= -noise
    assert row["save_predicted_rise_bytes"] > 0 and row["restore_predicted_bytes"] >= row["state_bytes"]
    line = checkpoint_host_peak.render(row)
    assert "save VmHWM " in line and "restore VmHWM " in line and "\n" not in line


def test_where_proc_has_no_vmhwm_the_peak_is_sampled_and_resets(monkeypatch):
    """gVisor (the TPU machine's sandbox) has VmRSS but no VmHWM: the sampler sees a short-lived 200 MB
    allocation after a reset, and a reset forgets it."""
    import time

    import numpy as np

    from benchmarks import resident_peak

    real = resident_peak._status_bytes
    monkeypatch.setattr(resident_peak, "_status_bytes", lambda field: None if field == "VmHWM" else real(field))
    peak = resident_peak.ResidentPeak()
    assert peak.source == "sampled VmRSS" and peak.reset()
    before = peak.peak()
    block = np.ones(200 * 2**20, np.uint8)   # written, so resident
    time.sleep(0.05)
    del block
    time.sleep(0.05)
    assert peak.peak() - before >= 150 * 2**20
    peak.reset()
    assert peak.peak() - before < 100 * 2**20
