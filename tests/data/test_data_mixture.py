"""Mixtures: the spec, batches that follow the weights, epochs per source, exact resume, several processes,
and the documents of several sources taken in turn (for training one tokenizer on all of them)."""

import json

import numpy as np
import pytest

from spillway.data import (BatchLoader, MixtureComponent, MixtureLoader, interleave_documents, parse_mixture,
                           prepare_mixture, stream_documents)

from tiny_corpus import make_documents

SEQ = 4


def _rows(source: int, count: int) -> np.ndarray:
    # Row i of source s holds 1000 * s + i: a batch row names its source and row.
    return np.repeat((1000 * source + np.arange(count, dtype=np.int64))[:, None], SEQ, axis=1).astype(np.uint16)


def _loader(**options) -> MixtureLoader:
    rows = {"web": _rows(0, 50), "code": _rows(1, 23), "math": _rows(2, 7)}
    weights = {"web": 5, "code": 3, "math": 2}
    return MixtureLoader(rows, weights, **{"global_batch_size": 10, "seed": 1, **options})


def _take(loader, steps):
    return [next(loader) for _ in range(steps)]


def test_parse_mixture():
    assert parse_mixture("web=0.7:/data/web, code=0.3:builtin:stdlib:200000,hub=1:hf:owner/name:cfg") == (
        MixtureComponent("web", 0.7, "/data/web"),
        MixtureComponent("code", 0.3, "builtin:stdlib:200000"),
        MixtureComponent("hub", 1.0, "hf:owner/name:cfg"),
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/data/web", "expected name=weight:source"),
        ("web=0.7", "expected name=weight:source"),
        ("web=lots:/data", "weight 'lots' is not a number"),
        ("web=0:/data", "weight must be a positive number, got 0"),
        ("web=-1:/data", "weight must be a positive number"),
        ("web=nan:/data", "weight must be a positive number"),
        ("my web=1:/data", "name 'my web' must be letters"),
        ("web=1:/a,web=2:/b", "names web more than once"),
    ],
)
def test_parse_mixture_names_each_mistake(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mixture(spec)


def test_batches_follow_the_weights():
    loader = _loader()
    counts = np.zeros(3, dtype=np.int64)
    for step in range(1, 301):
        per_batch = np.bincount(next(loader)[:, 0] // 1000, minlength=3)
        np.testing.assert_allclose(per_batch, [5, 3, 2], atol=1)  # every batch, within a row
        counts += per_batch
        np.testing.assert_allclose(counts / (10 * step), [0.5, 0.3, 0.2], atol=1 / (10 * step) + 1e-12)


def test_unequal_weights_over_many_batches():
    rows = {"a": _rows(0, 31), "b": _rows(1, 17)}
    loader = MixtureLoader(rows, {"a": 0.93, "b": 0.07}, global_batch_size=8, seed=0)
    sources = np.concatenate([next(loader)[:, 0] // 1000 for _ in range(500)])
    assert abs(np.mean(sources == 1) - 0.07) < 0.001


def test_each_source_serves_every_row_once_per_pass_and_reshuffles():
    loader = _loader()
    served = np.concatenate([batch[:, 0] for batch in _take(loader, 70)])  # 140 rows of "math": 20 passes
    math_rows = served[served // 1000 == 2] - 2000
    passes = math_rows[: 7 * (len(math_rows) // 7)].reshape(-1, 7)
    for visit in passes:
        assert sorted(visit) == list(range(7))
    assert len({tuple(visit) for visit in passes}) > 1


def test_resume_mid_mixture_continues_exactly():
    original = _loader()
    _take(original, 37)  # mid-pass for every source
    state = json.loads(json.dumps(original.state()))
    assert state["kind"] == "mixture" and state["step"] == 37 and sum(state["taken"].values()) == 370
    resumed = _loader()
    resumed.restore(state)
    for expected, actual in zip(_take(original, 25), _take(resumed, 25)):
        np.testing.assert_array_equal(expected, actual)


def test_processes_together_see_the_single_process_batches_and_resume_on_another_count():
    single = _loader()
    halves = [_loader(process_index=i, process_count=2) for i in range(2)]
    for _ in range(30):
        expected = next(single)
        assert expected.dtype == np.int32 and expected.shape == (10, SEQ)
        np.testing.assert_array_equal(np.concatenate([next(half) for half in halves]), expected)
    state = halves[0].state()
    fifths = [_loader(process_index=i, process_count=5) for i in range(5)]
    for loader in fifths:
        loader.restore(state)
    for _ in range(5):
        np.testing.assert_array_equal(np.concatenate([next(part) for part in fifths]), next(single))


def test_state_from_other_data_or_settings_is_refused():
    state = _loader().state()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        _loader(seed=2).restore(state)
    other = MixtureLoader({"web": _rows(0, 50)}, {"web": 1}, global_batch_size=10, seed=1)
    with pytest.raises(ValueError, match="sources: saved \\['code', 'math', 'web'\\], now \\['web'\\]"):
        other.restore(state)
    with pytest.raises(ValueError, match="not a mixture loader's"):
        _loader().restore(BatchLoader(_rows(0, 50), global_batch_size=10).state())


def test_bad_sources_are_rejected():
    with pytest.raises(ValueError, match="weights are given for \\['a'\\] but the sources are \\['b'\\]"):
        MixtureLoader({"b": _rows(0, 5)}, {"a": 1}, global_batch_size=2)
    with pytest.raises(ValueError, match="different row lengths"):
        MixtureLoader({"a": _rows(0, 5), "b": _rows(1, 5)[:, :2]}, {"a": 1, "b": 1}, global_batch_size=2)
    with pytest.raises(ValueError, match="'b': rows must be a non-empty"):
        MixtureLoader({"a": _rows(0, 5), "b": _rows(1, 0)}, {"a": 1, "b": 1}, global_batch_size=2)
    with pytest.raises(ValueError, match="not divisible by process_count 3"):
        MixtureLoader({"a": _rows(0, 5)}, {"a": 1}, global_batch_size=4, process_count=3)


def test_prepare_mixture_packs_each_source_for_one_loader(tokenizer, tmp_path):
    for name, seed in [("prose", 0), ("more", 1)]:
        (tmp_path / name).mkdir()
        for index, text in enumerate(make_documents(6, seed=seed)):
            (tmp_path / name / f"{index}.txt").write_text(text)
    components = parse_mixture(f"prose=3:{tmp_path / 'prose'},more=1:{tmp_path / 'more'}")
    packed = prepare_mixture(components, tokenizer, seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert list(packed) == ["prose", "more"]
    assert all(data.train.shape[1] == 17 and data.num_documents == 6 for data in packed.values())
    loader = MixtureLoader({name: data.train for name, data in packed.items()},
                           {c.name: c.weight for c in components}, global_batch_size=8)
    assert next(loader).shape == (8, 17)


def test_interleave_takes_one_document_from_each_source_in_turn_until_all_run_out(text_folder):
    files = stream_documents(str(text_folder))   # 12 local text files, read as a batched stream
    documents = list(interleave_documents([["<a0>", "<a1>", "<a2>"], files, iter(["<c0>"])]))
    texts = [text for text in documents if not text.startswith("<")]
    assert documents[:3] == ["<a0>", texts[0], "<c0>"]   # one of each, in the order the sources are given
    assert documents[3:7] == ["<a1>", texts[1], "<a2>", texts[2]]   # c ran out; a runs out after a2
    assert texts == [batch_text for batch in files.iter(batch_size=5) for batch_text in batch["text"]]
    assert len(documents) == 3 + 12 + 1


def test_a_source_smaller_than_its_share_of_a_batch_is_refused_naming_it():
    """Its one row was repeated 8 times in every batch of 16, without a word."""
    rows = {"big": np.zeros((100, 9), np.int32), "tiny": np.ones((1, 9), np.int32)}
    with pytest.raises(ValueError, match=r"mixture source 'tiny': only 1 rows for its share of a global batch \(8 of "
                                         r"16 at weight 0.5\), so its rows would repeat within every batch"):
        MixtureLoader(rows, {"big": 0.5, "tiny": 0.5}, global_batch_size=16)
    MixtureLoader(rows, {"big": 0.95, "tiny": 0.05}, global_batch_size=16)   # one row a batch: repeats across batches


def test_sources_that_read_the_same_files_are_warned_of(tmp_path):
    """A folder beside its own subfolder (or one folder twice) draws the shared documents under both weights:
    the mixture is then not what its weights say, which nothing told the user."""
    from spillway.data.mixture import shared_files_notes
    from spillway.data.sources import parse_local_spec

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.txt").write_text("alpha")
    (tmp_path / "code" / "b.txt").write_text("beta")
    (tmp_path / "web.txt").write_text("gamma")

    def files(**sources):
        return {name: parse_local_spec(str(path)).files for name, path in sources.items()}

    (note,) = shared_files_notes(files(all=tmp_path, code=tmp_path / "code"))
    assert "'all' and 'code' read 2 of the same files" in note and str(tmp_path / "code" / "a.txt") in note
    assert shared_files_notes(files(web=tmp_path / "web.txt", code=tmp_path / "code")) == []
