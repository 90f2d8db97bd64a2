"""`optimizer.update_on_host=true` with the optimizer state on device would do nothing: it is refused in one line.

The host CPU updates state that lives in pinned host memory; with the state in
HBM the GPU updates it whatever the setting says. The refusal comes from the
recipe itself, so it is said before any data is prepared or any run directory
taken.
"""

from __future__ import annotations

import pytest

from spillway.layers.errors import ConfigError
from spillway.recipes import cli
from spillway.recipes.registry import get_recipe

MESSAGE = ("optimizer.update_on_host=true runs the update of host optimizer state on the host CPU, but "
           "offload.optimizer_state=device keeps the state in HBM, where the GPU updates it: set "
           "offload.optimizer_state=host, or optimizer.update_on_host=false")


def test_the_cli_refuses_it_in_one_line_with_exit_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "tiny", "--set", "optimizer.update_on_host=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spillway train: error: --set optimizer.update_on_host=true: {MESSAGE}"]
    assert list(tmp_path.iterdir()) == []   # no run directory, no data cache


def test_a_host_update_recipe_moved_to_device_state_is_refused_and_host_state_is_accepted():
    with pytest.raises(ConfigError, match="keeps the state in HBM"):
        get_recipe("llama3_8b_offload", ["optimizer.update_on_host=true", "offload.optimizer_state=device"])
    assert get_recipe("llama3_8b_offload", ["optimizer.update_on_host=true"]).optimizer.update_on_host   # host state
    assert not get_recipe("llama3_8b_offload", ["offload.optimizer_state=device",
                                                "optimizer.update_on_host=false"]).optimizer.update_on_host
