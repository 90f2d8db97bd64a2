"""The tokenizer a run trained with stays its tokenizer: across a fine-tune, and across a resume.

* a fine-tune from a run that trained with a Hugging Face tokenizer.json keeps
  that file's name and its tokenizer_config.json (special tokens), so the chain
  train -> fine-tune -> generate works;
* a resumed run never retrains its tokenizer (RUN_DIR holds the one it trained
  with), and a local corpus edited since the run started is an error naming
  what changed (tests in this file below the fine-tune ones).
"""

from __future__ import annotations

import shutil

import pytest

from micro_recipe import micro
from user_files import BOS, EOS, copy_stdlib_corpus, write_hf_tokenizer
from spillway.data import load_tokenizer
from spillway.recipes.generate import generate_from_checkpoint
from spillway.recipes.train.checkpoint import RunCheckpointer
from spillway.recipes.train.corpus_record import CorpusChangedError
from spillway.recipes.train.loop import train


def saved_steps(run_dir):
    with RunCheckpointer(run_dir / "checkpoints", keep=10, every_steps=1) as ckpt:
        return ckpt.all_steps()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("new-user-cache")


@pytest.mark.slow  # an end-to-end run of 65 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
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
    shutil.rmtree(source_run)
    result = train(micro(cache_dir, tuned_run, "train.steps=3", f"checkpoint.init_from={source_run}"),
                   progress=False)
    assert result.final_step == 3 and result.tokenizer.fingerprint == tuned.fingerprint


def test_a_fine_tune_resumed_without_naming_its_source_again_keeps_it(tmp_path):
    """A fine-tune's recipe names its copy of the source's tokenizer; resumed without checkpoint.init_from (its
    steps hold the whole model), data.tokenizer was unset and the resume refused as a change of tokenizer, with
    advice to fine-tune with checkpoint.init_from. The run's folder is laid out by hand here: no training."""
    import jax.numpy as jnp

    from spillway.recipes.train.loop import _before_data

    tuned = tmp_path / "tuned"
    write_hf_tokenizer(tuned)   # its copy of the source's tokenizer
    started = micro(tmp_path / "cache", tuned, f"checkpoint.init_from={tmp_path / 'source'}",
                    f"data.tokenizer={tuned / 'tokenizer.json'}")
    with RunCheckpointer(tuned / "checkpoints", keep=1, every_steps=1, async_save=False) as checkpointer:
        checkpointer.save(2, params={"w": jnp.zeros(2)}, opt_state={"m": jnp.zeros(2)}, loader_state={},
                          meta={"step": 2}, recipe_json=started.to_json(), force=True)
        said = []
        recipe, candidates, own_tokenizer, _, _ = _before_data(micro(tmp_path / "cache", tuned), tuned,
                                                               checkpointer, said.append)
    assert candidates == [2] and own_tokenizer == tuned / "tokenizer.json"
    assert recipe.checkpoint.init_from == str(tmp_path / "source")   # kept: its next steps name it too
    assert recipe.data.tokenizer == str(tuned / "tokenizer.json")


# -- a resumed run and its corpus ---------------------------------------------------------------------


@pytest.fixture
def run_and_corpus(cache_dir, tmp_path):
    """Two steps trained on a local copy of the micro corpus, with a tokenizer trained on it (a recipe names
    its corpus by path, so each test trains its own)."""
    corpus = copy_stdlib_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    train(micro(cache_dir, run_dir, "train.steps=2", source=str(corpus)), progress=False)
    return corpus, run_dir


def resume(cache_dir, run_dir, corpus, steps=3, said=None):
    # the run's recipe names its corpus by path: the copies keep it, as a run moved elsewhere would
    return train(micro(cache_dir, run_dir, f"train.steps={steps}", source=str(corpus)), progress=False,
                 echo=(said.append if said is not None else print))


def test_a_resumed_run_whose_corpus_was_edited_fails_naming_what_changed(cache_dir, run_and_corpus):
    corpus, run_dir = run_and_corpus
    tokenizer_before = (run_dir / "tokenizer.model").read_bytes()
    edited = sorted(corpus.iterdir())
    for path in edited:   # the edit: one word replaced in every file, one file trimmed
        path.write_bytes(path.read_bytes().replace(b"return", b"yield", 1))
    edited[0].write_bytes(edited[0].read_bytes()[:200])
    with pytest.raises(CorpusChangedError, match=rf"corpus changed since this run started \({len(edited)} "
                                                 rf"files changed \(size or modification time\): "
                                                 rf"{edited[0]}.*delete {run_dir / 'corpus.json'}"):
        resume(cache_dir, run_dir, corpus)
    assert (run_dir / "tokenizer.model").read_bytes() == tokenizer_before
    assert saved_steps(run_dir) == [2]


def test_a_run_moved_with_its_corpus_resumes_naming_the_corpus_at_its_new_place(cache_dir, run_and_corpus,
                                                                                   tmp_path):
    """A project folder moved whole (`mv`, which keeps the files' times): data.source named at its new place was
    "data.source was ... in the saved run", and named relatively, corpus.json's absolute paths made every file
    "removed" and "added". The same files below another folder are the same corpus; an edited one is not."""
    corpus, run_dir = run_and_corpus
    shutil.move(tmp_path, tmp_path.with_name(tmp_path.name + "-moved"))
    moved = tmp_path.with_name(tmp_path.name + "-moved")
    assert resume(cache_dir, moved / "run", moved / "corpus").final_step == 3
    edited = sorted((moved / "corpus").iterdir())[0]
    edited.write_bytes(edited.read_bytes()[:200])
    with pytest.raises(CorpusChangedError, match="changed \\(size or modification time\\)"):
        resume(cache_dir, moved / "run", moved / "corpus", steps=4)


@pytest.mark.slow  # four runs of the micro recipe: about a minute on 2 cores
def test_an_accepted_edited_corpus_keeps_the_run_tokenizer_and_a_new_row_count_says_the_corpus_changed(
        cache_dir, run_and_corpus):
    corpus, run_dir = run_and_corpus
    tokenizer_before = (run_dir / "tokenizer.model").read_bytes()
    said = []
    # unchanged: resumes, from the packed cache (the run's tokenizer is the one the cache was keyed by)
    assert resume(cache_dir, run_dir, corpus, steps=3, said=said).final_step == 3
    assert not any("corpus.json is absent" in line for line in said) and any("(cached" in line for line in said)
    # an edit that keeps every token count (two lines of one file swapped), accepted by deleting corpus.json,
    # the documented way; a run from before corpus records (no corpus.json) resumes the same way
    target = sorted(corpus.iterdir())[3]
    lines = target.read_text().splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]
    target.write_text("".join(lines))
    (run_dir / "corpus.json").unlink()
    said.clear()
    result = resume(cache_dir, run_dir, corpus, steps=4, said=said)
    assert result.final_step == 4
    assert any("corpus.json is absent" in line and "recording it as it is now" in line for line in said)
    assert (run_dir / "tokenizer.model").read_bytes() == tokenizer_before   # never retrained
    assert result.tokenizer.fingerprint == load_tokenizer(run_dir).fingerprint
    assert (run_dir / "corpus.json").is_file()
    # a corpus that packs into other rows: the loader's message says the corpus changed
    files = sorted(corpus.iterdir())
    kept = {path: path.read_bytes() for path in files[:len(files) // 2]}
    for path in kept:
        path.unlink()
    (run_dir / "corpus.json").unlink()
    with pytest.raises(ValueError, match=r"num_rows: saved \d+, now \d+\); the corpus packs into another number "
                                         r"of rows.*the corpus \(or its tokenization\) changed"):
        resume(cache_dir, run_dir, corpus, steps=5)
    assert (run_dir / "tokenizer.model").read_bytes() == tokenizer_before
    # the refused resume recorded nothing: with the files put back, as its message advises, the run resumes
    assert not (run_dir / "corpus.json").exists()
    for path, content in kept.items():
        path.write_bytes(content)
    assert resume(cache_dir, run_dir, corpus, steps=5).final_step == 5


def test_a_tokenizer_edited_in_place_since_the_run_started_is_refused_at_resume(tmp_path):
    """A new user's finding: the tokenizer a run names, edited where it lies (its EOS renamed, or retrained with
    pieces swapped), was read by the resume without a word (same path, so the recipe compared equal), trained on
    under other ids, and overwrote the run's own copy. The resume reads the run's copy, and a named tokenizer
    that gives other ids is refused in one line."""
    import json

    from spillway.recipes.train.tokenization_record import TokenizerChangedError, kept_tokenizer_file

    named = write_hf_tokenizer(tmp_path / "mytok")
    run_dir = tmp_path / "run"
    load_tokenizer(named).save_to_directory(run_dir)   # what a run keeps when it starts
    own = run_dir / "tokenizer.json"
    assert kept_tokenizer_file(run_dir, str(named)) == own
    assert kept_tokenizer_file(run_dir, str(tmp_path / "gone")) == own   # a named tokenizer removed since
    assert kept_tokenizer_file(tmp_path / "no-copy", str(named)) is None  # a run that saved none reads the named
    config = named / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": BOS, "bos_token": BOS}))   # the EOS renamed in place
    with pytest.raises(TokenizerChangedError, match=r"cannot resume: data.tokenizer .*mytok' gives other ids than "
                                                    r"the copy this run trained with .*run/tokenizer.json"):
        kept_tokenizer_file(run_dir, str(named))
    config.write_text(json.dumps({"eos_token": EOS, "bos_token": BOS, "add_bos_token": True}))
    assert kept_tokenizer_file(run_dir, str(named)) == own   # a BOS is the BOS record's to compare, not this
    (named / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerChangedError, match="cannot be read"):
        kept_tokenizer_file(run_dir, str(named))
