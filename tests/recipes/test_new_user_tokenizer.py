"""The tokenizer a run trained with stays its tokenizer: across a fine-tune, and across a resume.

* a fine-tune from a run that trained with a Hugging Face tokenizer.json keeps
  that file's name and its tokenizer_config.json (special tokens), so the chain
  train -> fine-tune -> generate works;
* a resumed run never retrains its tokenizer (RUN_DIR holds the one it trained
  with), and a local corpus edited since the run started is an error naming
  what changed (tests in this file below the fine-tune ones).
"""

from __future__ import annotations

import pytest

from new_user_fixtures import BOS, EOS, micro, write_hf_tokenizer
from spillway.data import load_tokenizer
from spillway.recipes.generate import generate_from_checkpoint
from spillway.recipes.train.loop import train


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("new-user-cache")


def test_finetune_keeps_a_tokenizer_json_and_its_special_tokens(cache_dir, tmp_path):
    hf = write_hf_tokenizer(tmp_path / "hf-tokenizer")
    source_run, tuned_run = tmp_path / "source", tmp_path / "tuned"
    train(micro(cache_dir, source_run, "train.steps=2", f"data.tokenizer={hf}"), progress=False)
    said = []
    train(micro(cache_dir, tuned_run, "train.steps=2", f"checkpoint.init_from={source_run}"), progress=False,
          echo=said.append)
    assert (tuned_run / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert not (tuned_run / "tokenizer.model").exists()   # a tokenizer.json is never renamed as sentencepiece
    tuned = load_tokenizer(tuned_run)
    assert tuned.fingerprint == load_tokenizer(hf).fingerprint
    assert tuned.token_text(tuned.eos_id) == EOS and tuned.token_text(tuned.bos_id) == BOS
    assert any(f"copied to {tuned_run / 'tokenizer.json'}" in line for line in said)
    text = generate_from_checkpoint(str(tuned_run), "def ", max_new_tokens=4, temperature=0.0, top_p=1.0)
    assert text.startswith("def ")
    # and the fine-tune resumes with the copy it made (the source may be gone by then)
    import shutil
    shutil.rmtree(source_run)
    result = train(micro(cache_dir, tuned_run, "train.steps=3", f"checkpoint.init_from={source_run}"),
                   progress=False)
    assert result.final_step == 3 and result.tokenizer.fingerprint == tuned.fingerprint
