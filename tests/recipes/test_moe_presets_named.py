"""A dense preset on an MoE model names the presets that serve it; the README's preset table lists the MoE ones.

`offload_dots` names the dense MLP's activations (`mlp_hidden`, `mlp_out`),
which an MoE block never tags: the one-line error says it is an MoE block and
which presets apply (the `moe_*` ones and the three that name no MLP tag).
"""

from __future__ import annotations

from pathlib import Path

from spillway.layers.offload import MOE_PRESETS, PRESETS, presets_for
from spillway.recipes import cli

README = Path(__file__).resolve().parents[2] / "README.md"
SERVE_MOE = ["save_all", "recompute_all", "offload_inputs", *MOE_PRESETS]


def test_a_dense_preset_on_an_moe_recipe_names_the_moe_presets_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "mixtral_tiny", "--set", "offload.activations=offload_dots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spillway train: error: remat plan names ['mlp_hidden', 'mlp_out']")
    assert err[0].endswith("This is an MoE block, whose expert activations only the moe_* presets name (README, "
                           "Offload policies); the presets that serve it: " + ", ".join(SERVE_MOE))


def test_presets_for_a_dense_block_are_the_dense_presets():
    dense_tags = frozenset().union(*(policy.names() for policy in PRESETS.values()))
    assert presets_for(dense_tags) == list(PRESETS)


def test_the_readme_preset_tables_list_every_preset_once():
    text = README.read_text()
    for name in [*PRESETS, *MOE_PRESETS]:
        assert text.count(f"| `{name}` |") == 1, name
