"""`spillway generate --prompt` (and a text run's closing sample) stops at every token the run's export lists in
its generation_config.json: a run that keeps a chat template ends its answers with the template's end of turn,
which transformers' generate() on the export stops at, so `--temperature 0` gives the tokens it gives.

It stopped at the EOS alone and ran on past a chat run's <|im_end|> (with transformers' stopping there).
"""

from __future__ import annotations

import json

import pytest

from micro_recipe import micro
from user_files import write_hf_tokenizer
from spillway.recipes import generate as generate_module
from spillway.recipes.export import export_run
from spillway.recipes.train.loop import train

END_OF_TURN = "<|im_end|>"
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.mark.slow  # one micro run and its export: about 30 s on 2 busy cores
def test_a_prompt_stops_at_every_token_the_export_stops_at(tmp_path, monkeypatch):
    hf = write_hf_tokenizer(tmp_path / "tokenizer", other_specials=(END_OF_TURN,))
    (hf / "chat_template.jinja").write_text(TEMPLATE)   # kept by the run, as a base model's template is
    run_dir = tmp_path / "run"
    train(micro(tmp_path / "cache", run_dir, "train.steps=1", f"data.tokenizer={hf}"), progress=False,
          echo=lambda *_: None)
    export_run(str(run_dir), str(tmp_path / "export"), say=lambda line: None)
    export_stops = json.loads((tmp_path / "export" / "generation_config.json").read_text())["eos_token_id"]
    assert len(export_stops) == 2   # the EOS and the template's end of turn

    real, stops = generate_module.generate, []

    def noting_stops(model, prompt_ids, **settings):
        stops.extend([settings["stop_id"], *settings["stop_ids"]])
        return real(model, prompt_ids, **settings)
    monkeypatch.setattr(generate_module, "generate", noting_stops)
    generate_module.generate_from_checkpoint(str(run_dir), "def ", max_new_tokens=2, temperature=0.0, top_p=1.0)
    assert set(export_stops) <= set(stops), (export_stops, stops)
