"""An empty prompt (`spillway generate RUN --prompt ""`, `train.sample_prompt=""`) on a run whose tokenizer puts
no BOS first, as GPT-2's and Qwen's do: the continuation starts after an EOS, as every document after the first
did, and that EOS is not printed as text (the sample began with '<|endoftext|>')."""

from __future__ import annotations

import pytest

from micro_recipe import micro
from user_files import EOS, write_hf_tokenizer
from spillway.data import load_tokenizer
from spillway.recipes.generate import generate_from_checkpoint
from spillway.recipes.train.chat_prompt import text_prompt
from spillway.recipes.train.loop import train


def test_an_empty_text_starts_after_an_eos_kept_out_of_the_text(tmp_path):
    folder = write_hf_tokenizer(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(folder)   # no BOS put first
    eos = tokenizer.eos_id
    assert text_prompt(folder, tokenizer, "") == ([eos], [eos], [eos])
    assert text_prompt(folder, tokenizer, "def ") == ([], tokenizer.encode(["def "])[0], [eos])
    with_bos = tokenizer.with_bos(True)
    assert text_prompt(folder, with_bos, "")[:2] == ([with_bos.bos_id], [with_bos.bos_id])


@pytest.mark.slow  # one micro run: about 30 s on 2 busy cores
def test_an_empty_prompt_prints_no_eos_in_the_closing_sample_nor_in_generate(tmp_path):
    hf = write_hf_tokenizer(tmp_path / "tokenizer")
    run_dir = tmp_path / "run"
    result = train(micro(tmp_path / "cache", run_dir, "train.steps=1", f"data.tokenizer={hf}",
                         "train.sample_prompt=", "train.sample_tokens=4"), progress=False, echo=lambda *_: None)
    assert result.sample is not None and EOS not in result.sample, result.sample
    text = generate_from_checkpoint(str(run_dir), "", max_new_tokens=4, temperature=0.0, top_p=1.0)
    assert EOS not in text, text
