"""The recipe-to-data glue: one corpus or a mixture becomes one tokenizer, packed rows per source, and a loader.

Offline: the mixture is the embedded stdlib corpus (code) and a folder of generated prose (prose_corpus.py).
"""

import pytest

from prose_corpus import MARKER, write_prose
from spillway.data import BatchLoader, MixtureLoader
from spillway.layers.errors import DataError
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.data_pipeline import CORPUS, prepare


def small(cache, *extra):
    return get_recipe("tiny", [f"data.cache_dir={cache}", "data.seq_len=32", "data.num_proc=1",
                               "model.vocab_size=512", "train.global_batch=8", *extra])


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    return write_prose(tmp_path_factory.mktemp("prose"))


def test_a_mixture_is_packed_per_source_with_one_tokenizer_that_saw_every_source(prose, tmp_path):
    recipe = small(tmp_path, f"data.mixture=code=3:builtin:stdlib:400000,prose=1:{prose}", "data.val_fraction=0.2")
    tokenizer, data = prepare(recipe)
    assert data.is_mixture and list(data.sources) == ["code", "prose"]
    assert data.weights == {"code": 0.75, "prose": 0.25}   # normalised
    assert all(packed.seq_len == 32 and len(packed.train) > 100 for packed in data.sources.values())
    # The tokenizer trained on both sources in turn: the word only the prose holds is nearly one piece.
    assert len(tokenizer.encode([MARKER])[0]) <= 2
    loader = data.loader(recipe, 0, 1)
    assert isinstance(loader, MixtureLoader)
    for _ in range(25):
        next(loader)
    assert loader.state()["taken"] == {"code": 150, "prose": 50}   # 200 rows, exactly 3:1
    assert set(data.validation_sets()) == {"code", "prose"}


def test_one_corpus_keeps_its_batch_loader(tmp_path):
    recipe = small(tmp_path, "data.source=builtin:stdlib:200000", "train.eval_every=0")
    _, data = prepare(recipe)
    assert not data.is_mixture and list(data.sources) == [CORPUS]
    assert isinstance(data.loader(recipe, 0, 1), BatchLoader)


def test_a_source_too_small_to_validate_is_one_error_naming_it(prose, tmp_path):
    recipe = small(tmp_path, f"data.mixture=code=3:builtin:stdlib:200000,prose=1:{prose}",
                   "data.val_fraction=0.01", "train.global_batch=64")
    with pytest.raises(DataError, match=r"data.mixture source 'code': \d+ validation rows, fewer than one global "
                                        r"batch \(64 rows\).*raise data.val_fraction \(now 0.01\) or set "
                                        r"train.eval_every=0"):
        prepare(recipe)


def test_a_resume_too_small_to_validate_is_told_what_a_resume_accepts(tmp_path):
    """A resume (its corpus edited since, or train.eval_every raised) was told to raise data.val_fraction, which
    the resume then refused: it keeps the validation split and the global batch."""
    recipe = small(tmp_path, "data.source=builtin:stdlib:200000", "data.val_fraction=0.01", "train.global_batch=64")
    with pytest.raises(DataError, match=r"fewer than one global batch \(64 rows\), so it cannot be evaluated: a "
                                        r"resume keeps data.val_fraction \(0.01\) and the global batch, so set "
                                        r"train.eval_every=0 \(or train into another checkpoint.dir") as refused:
        prepare(recipe, resuming=True)
    assert "raise data.val_fraction" not in str(refused.value)


def test_a_mixture_source_that_cannot_be_read_is_named_with_the_format_every_source_shares():
    """A chat source beside text ones was told 'set data.format=text', which the chat source then failed."""
    import pytest

    from spillway.data import MixtureComponent
    from spillway.layers.errors import DataError
    from spillway.recipes.train.data_pipeline import _each_source

    def prepare(source):
        if source == "text.jsonl":
            raise DataError("data.format=chat: record text.jsonl, line 1 has no \"messages\"; a text corpus? set "
                            "data.format=text")
        return source

    components = [MixtureComponent("c", 0.5, "chat.jsonl"), MixtureComponent("t", 0.5, "text.jsonl")]
    with pytest.raises(DataError, match=r"^data.mixture source 't': data.format=chat: .* \(every source of a mixture "
                                        r"is read as data.format=chat: mix sources of one format\)$"):
        _each_source(components, "chat", prepare)
    assert _each_source(components[:1], "chat", prepare) == {"c": "chat.jsonl"}


def test_chat_settings_given_to_a_text_run_are_named_as_not_read():
    from spillway.recipes.config import DataConfig
    from spillway.recipes.train.run_data import _chat_settings_unread

    assert _chat_settings_unread(DataConfig()) == []
    assert _chat_settings_unread(DataConfig(chat_template="missing.jinja", packing="pad")) == [
        "data.chat_template=missing.jinja", "data.packing=pad"]
    assert _chat_settings_unread(DataConfig(format="chat", chat_template="chatml", packing="pad")) == []


def test_a_mixture_whose_sources_read_the_same_files_is_warned_of_with_the_runs_notes(tmp_path):
    """The run's data lines: each source's own notes, and the pair of sources that read the same files (the
    shared documents are drawn under both weights)."""
    from spillway.recipes.train.data_pipeline import source_notes_of

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.txt").write_text("alpha")
    (tmp_path / "web.txt").write_text("gamma")
    (tmp_path / "notes.rst").write_text("not read")
    recipe = get_recipe("tiny", [f"data.mixture=all=0.5:{tmp_path},code=0.5:{tmp_path / 'code'},hub=1:hf:o/n"])
    notes = source_notes_of(recipe)
    assert any("notes.rst (not a corpus file type)" in line for line in notes)
    assert notes[-1].startswith("warning: data.mixture sources 'all' and 'code' read 1 of the same files")
