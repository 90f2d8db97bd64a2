"""benchmarks/gpu_suite.py on CPU: the GPU session's one script must not fail for the first time on the GPU.

Device time is short (minutes per session), so the measuring code and the
table are run here on a tiny recipe with host-resident optimizer state (CPU
has pinned_host memory too) across the 8 fake devices of tests/conftest.py.
The GPU machine has no `datasets` (it is a dependency of the package, so every
test environment has it): the measuring code runs in a child process in which
importing `datasets` fails, as it would there.
"""

import pytest
import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_suite

REPO = Path(__file__).resolve().parents[2]

# Child: block `datasets` (and its submodules) before anything is imported, then
# run one case as the suite's child process would and print its JSON line.
CHILD = """
import importlib.abc, json, sys

class NoDatasets(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machine has none)")
        return None

sys.meta_path.insert(0, NoDatasets())
sys.path.insert(0, REPO_ROOT)
from benchmarks import gpu_suite
result = gpu_suite.measure_case(
    "1b/recompute_all/host", warmup=1, timed=2, case=gpu_suite.Case("tiny", "recompute_all", "host", 32),
    extra_overrides=("train.global_batch=8", "model.max_seq_len=64"))
assert not any(m == "datasets" or m.startswith("datasets.") for m in sys.modules), "datasets got imported"
print(json.dumps(result))
"""


def _child_code() -> str:
    return CHILD.replace("REPO_ROOT", repr(str(REPO)))


def _run_child(code: str) -> subprocess.CompletedProcess:
    # The environment is this process's: 8 fake CPU devices (tests/conftest.py).
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_the_datasets_blocker_works():
    # Without this, the test below could pass because nothing was blocked.
    code = _child_code().split("from benchmarks")[0] + "import datasets\n"
    out = _run_child(code)
    assert out.returncode != 0 and "blocked: the GPU machine has none" in out.stderr


@pytest.mark.slow  # an end-to-end run of 31 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_measure_case_and_table_run_on_cpu_without_datasets():
    out = _run_child(_child_code())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert result["step_s"] > 0 and result["tokens_per_s"] == 8 * 32 / result["step_s"]
    assert result["compiled_hbm_bytes"] > 0 and math.isfinite(result["loss"])
    device = dict(result, case="1b/recompute_all/device", step_s=result["step_s"] / 2)
    predictions = {"1b/recompute_all/host": {"hbm_bytes": 2 * result["compiled_hbm_bytes"], "step_s": 0.1}}
    table = gpu_suite.render_table([result, device, {"case": "8b/save_all/device", "error": "OOM"}],
                                   predictions)
    assert "1b/recompute_all/host" in table and "OOM" in table
    assert "host-resident optimizer state step time overhead: 2.000x" in table


def test_every_case_is_a_recipe_that_builds_with_its_overrides():
    # A recipe change (e.g. a shorter max_seq_len) must not break a case only on the GPU machine.
    from spillway.recipes.registry import get_recipe
    for name, case in gpu_suite.CASES.items():
        recipe = get_recipe(case.recipe, gpu_suite.case_overrides(case))
        assert (recipe.data.seq_len, recipe.train.global_batch, recipe.train.grad_accum) == (
            case.seq_len, case.global_batch, case.grad_accum), name


def test_the_split_cases_run_by_default_and_build_with_their_split():
    """The per-layer split rows (issue 29) are in the default call, each beside its device and host rows,
    and their recipes place the state as the case names it (the test above builds every case)."""
    from spillway.layers.residency import host_layers
    from spillway.recipes.registry import get_recipe
    for name in ("1b/recompute_all/split/cudnn/ga8", "3b/recompute_all/split/cudnn/ga8",
                 "8b/save_qkv_offload_mlp/split_pick/cudnn/ga8", "1b/offload_dots8+recompute_all/split_pick/cudnn/ga8",
                 "3b/save_qkv_offload_mlp/split_pick/cudnn/ga8"):
        assert name in gpu_suite.DEFAULT_CASES
        recipe = get_recipe(gpu_suite.CASES[name].recipe, gpu_suite.case_overrides(gpu_suite.CASES[name]))
        assert 0 < host_layers(recipe.offload.optimizer_state, recipe.model.num_layers) < recipe.model.num_layers
    first = gpu_suite.DEFAULT_CASES.index
    assert first("1b/recompute_all/host/cudnn/ga8") < first("1b/recompute_all/split/cudnn/ga8")
