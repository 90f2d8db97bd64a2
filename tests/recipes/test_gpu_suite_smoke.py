"""benchmarks/gpu_suite.py on CPU: the GPU session's one script must not fail for the first time on the GPU.

Device time is short (minutes per session), so the measuring code and the
table are run here on a tiny recipe with host-resident optimizer state (CPU
has pinned_host memory too) across the 8 fake devices of tests/conftest.py.
"""

import json
import math

from benchmarks import gpu_suite


def test_measure_case_and_table_run_on_cpu():
    result = gpu_suite.measure_case(
        "1b/recompute_all/host", warmup=1, timed=2, case=("tiny", "recompute_all", "host"), seq_len=32,
        extra_overrides=("train.global_batch=8", "model.max_seq_len=64"))
    json.dumps(result)   # the child prints it as JSON
    assert result["step_s"] > 0 and result["tokens_per_s"] == 8 * 32 / result["step_s"]
    assert result["compiled_hbm_bytes"] > 0 and math.isfinite(result["loss"])
    device = dict(result, case="1b/recompute_all/device", step_s=result["step_s"] / 2)
    predictions = {"1b/recompute_all/host": {"hbm_bytes": 2 * result["compiled_hbm_bytes"], "step_s": 0.1}}
    table = gpu_suite.render_table([result, device, {"case": "8b/save_all/device", "error": "OOM"}],
                                   predictions)
    assert "1b/recompute_all/host" in table and "OOM" in table
    assert "host-resident optimizer state step time overhead: 2.000x" in table
