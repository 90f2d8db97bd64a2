"""A run keeps the tokenization it started with: a resumed run from before BOS were added adds none, and says so.

End to end through the train loop (slow: two micro runs). The units it wires
together (recorded_bos, describe_kept_bos, Tokenizer.with_bos) are tested in
the default suite in tests/data/test_bos.py.
"""

from __future__ import annotations

import json

import pytest

from micro_recipe import micro
from user_files import BOS, write_hf_tokenizer
from spillway.recipes.train.loop import train


def with_bos_post_processor(directory):
    """The fixture's tokenizer.json given Llama 3's kind of post-processor: a BOS before every text."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.slow  # two micro training runs: about a minute on 2 busy cores
def test_a_run_from_before_bos_resumes_without_one_and_says_so(tmp_path):
    hf = with_bos_post_processor(write_hf_tokenizer(tmp_path / "hf"))
    run_dir = tmp_path / "run"
    # a run as spillway made one before BOS were added: no BOS, and neither its saved recipe nor its
    # tokenizer_config.json says anything about them
    first = train(micro(tmp_path / "cache", run_dir, "train.steps=1", f"data.tokenizer={hf}", "data.add_bos=false"),
                  progress=False, echo=lambda *_: None)
    assert not first.tokenizer.adds_bos
    config = json.loads((run_dir / "tokenizer_config.json").read_text())
    assert config.pop("add_bos_token") is False
    (run_dir / "tokenizer_config.json").write_text(json.dumps(config))
    for saved in run_dir.glob("checkpoints/*/recipe/recipe.json"):
        recipe = json.loads(saved.read_text())
        del recipe["data"]["add_bos"]
        saved.write_text(json.dumps(recipe))
    said = []
    resumed = train(micro(tmp_path / "cache", run_dir, "train.steps=2", f"data.tokenizer={hf}"), progress=False,
                    echo=said.append)
    assert resumed.final_step == 2 and not resumed.tokenizer.adds_bos   # a new run would add one
    lines = [line for line in said if line.startswith("tokenizer: this run started without a BOS")]
    assert len(lines) == 1 and repr(BOS) in lines[0]
    assert json.loads((run_dir / "tokenizer_config.json").read_text())["add_bos_token"] is False
