"""Token shards: boundaries, independence from chunking and processes, resume after a kill or a failed stream."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

import spillway.data.encoding as encoding_module
import spillway.data.shards as shards_module
import spillway.data.sources as sources_module
from spillway.data import prepare_tokens, prepare_token_shards

from tiny_corpus import make_documents

SHARD_TOKENS = 600


@pytest.fixture
def corpus(tmp_path):
    """40 text documents, about 10 shards of SHARD_TOKENS with the session tokenizer."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for index, text in enumerate(make_documents(40, seed=4)):
        (folder / f"doc{index:02d}.txt").write_text(text)
    return folder


def _shard_files(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.glob("shard-*.npy"))}


def _prepare(corpus, tokenizer, cache, **options):
    return prepare_tokens(str(corpus), tokenizer, seq_len=16, val_fraction=0.1, cache_dir=cache,
                          shard_tokens=SHARD_TOKENS, **options)


def _shards_folder(cache: Path) -> Path:
    (folder,) = (cache / "tokens").iterdir()
    return folder


def test_shards_close_at_the_first_document_reaching_shard_tokens(corpus, tokenizer, tmp_path):
    _prepare(corpus, tokenizer, tmp_path)
    folder = _shards_folder(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    texts = [path.read_text() for path in sorted(corpus.iterdir())]
    expected = [ids + [tokenizer.eos_id] for ids in tokenizer.encode(texts)]
    assert manifest["complete"] and manifest["dtype"] == "uint16" and len(manifest["shards"]) >= 5
    next_document = 0
    for shard in manifest["shards"]:
        tokens = np.load(folder / f"shard-{shard['index']:05d}.tokens.npy")
        lengths = np.load(folder / f"shard-{shard['index']:05d}.lengths.npy")
        assert shard["first_document"] == next_document and shard["num_documents"] == len(lengths)
        documents = expected[next_document : next_document + len(lengths)]
        assert lengths.tolist() == [len(ids) for ids in documents]
        assert tokens.tolist() == [token for ids in documents for token in ids]
        if shard is not manifest["shards"][-1]:
            assert lengths.sum() >= SHARD_TOKENS > lengths[:-1].sum()
        next_document += len(lengths)
    assert next_document == 40


def test_shards_do_not_depend_on_chunking_or_processes(corpus, tokenizer, tmp_path, monkeypatch):
    _prepare(corpus, tokenizer, tmp_path / "default")
    _prepare(corpus, tokenizer, tmp_path / "processes", num_proc=2)
    monkeypatch.setattr(shards_module, "text_chunks", functools.partial(encoding_module.text_chunks, chunk_chars=1))
    _prepare(corpus, tokenizer, tmp_path / "one-document-chunks")
    reference = _shard_files(_shards_folder(tmp_path / "default"))
    assert _shard_files(_shards_folder(tmp_path / "processes")) == reference
    assert _shard_files(_shards_folder(tmp_path / "one-document-chunks")) == reference


# Runs a preparation and SIGKILLs itself while writing shard 3: its tokens
# file is in place, its lengths file half-written under a temporary name, and
# the manifest still lists shards 0-2 only.
_KILLED_CHILD = """
import os, signal, sys
import spillway.data.cache as cache
import spillway.data.shards as shards
from spillway.data import load_tokenizer, prepare_tokens

def write_or_die(path, array):
    if path.name == "shard-00003.lengths.npy":
        cache._temporary_sibling(path).write_bytes(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)
    cache.atomic_write_array(path, array)

shards.write_shard_file = write_or_die
corpus, tokenizer, cache_dir, shard_tokens = sys.argv[1:]
prepare_tokens(corpus, load_tokenizer(tokenizer), seq_len=16, val_fraction=0.1, cache_dir=cache_dir,
               shard_tokens=int(shard_tokens))
"""


def test_a_killed_preparation_resumes_from_its_finished_shards(corpus, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "killed"
    environment = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, str(corpus), str(tokenizer.save(tmp_path / "t.model")),
         str(cache), str(SHARD_TOKENS)],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == -9, child.stderr
    folder = _shards_folder(cache)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert not manifest["complete"] and [shard["index"] for shard in manifest["shards"]] == [0, 1, 2]
    assert (folder / "shard-00003.tokens.npy").is_file() and list(folder.glob(".*.tmp-*"))
    assert not (cache / "packed").exists() or not any((cache / "packed").iterdir())
    finished = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in folder.glob("shard-0000[012].*")}
    resumed_from = sum(shard["num_documents"] for shard in manifest["shards"])

    encoded = []
    real_encode = encoding_module.encode_texts
    monkeypatch.setattr(
        encoding_module, "encode_texts", lambda tk, texts, *a, **k: encoded.extend(texts) or real_encode(tk, texts, *a, **k)
    )
    resumed = _prepare(corpus, tokenizer, cache)
    assert len(encoded) == 40 - resumed_from  # only the documents after the finished shards
    assert {path.name: (path.stat().st_ino, path.stat().st_mtime_ns)
            for path in folder.glob("shard-0000[012].*")} == finished  # not rewritten
    assert not list(folder.glob(".*.tmp-*"))

    monkeypatch.setattr(encoding_module, "encode_texts", real_encode)
    uninterrupted = _prepare(corpus, tokenizer, tmp_path / "uninterrupted")
    assert _shard_files(folder) == _shard_files(_shards_folder(tmp_path / "uninterrupted"))
    np.testing.assert_array_equal(resumed.train, uninterrupted.train)
    np.testing.assert_array_equal(resumed.val, uninterrupted.val)


def test_a_failed_stream_resumes_where_its_shards_end(tokenizer, tmp_path, monkeypatch):
    texts = [f"document {i}: the model reads tokens " * 2 for i in range(1500)]
    fail_after = []  # documents the stream gives before failing; empty: it never fails

    def rows():
        for index, text in enumerate(texts):
            if fail_after and index == fail_after[0]:
                raise ConnectionError("the Hub went away")
            yield {"text": text}

    monkeypatch.setattr(sources_module.datasets, "load_dataset",
                        lambda **kwargs: datasets.IterableDataset.from_generator(rows))
    # Chunks of a few documents, so that shards are written before the failure.
    monkeypatch.setattr(shards_module, "text_chunks", functools.partial(encoding_module.text_chunks, chunk_chars=500))
    options = dict(seq_len=8, val_fraction=0, shard_tokens=3000)
    fail_after.append(1200)  # past the first batch of 1000 documents that `datasets` filters at once
    with pytest.raises(ConnectionError):
        prepare_tokens("hf:owner/name", tokenizer, cache_dir=tmp_path / "a", **options)
    manifest = json.loads((_shards_folder(tmp_path / "a") / "manifest.json").read_text())
    assert manifest["shards"] and not manifest["complete"]
    fail_after.clear()
    resumed = prepare_tokens("hf:owner/name", tokenizer, cache_dir=tmp_path / "a", **options)
    whole = prepare_tokens("hf:owner/name", tokenizer, cache_dir=tmp_path / "b", **options)
    assert resumed.num_documents == whole.num_documents == 1500
    assert _shard_files(_shards_folder(tmp_path / "a")) == _shard_files(_shards_folder(tmp_path / "b"))
    np.testing.assert_array_equal(resumed.train, whole.train)


def test_capped_preparation_resumes_to_the_same_cap(corpus, tokenizer, tmp_path, monkeypatch):
    real_write = shards_module.write_shard_file
    written = []

    def write_then_fail(path, array):
        real_write(path, array)
        written.append(path.name)
        if len(written) == 4:  # two whole shards
            raise KeyboardInterrupt

    monkeypatch.setattr(shards_module, "write_shard_file", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus, tokenizer, tmp_path / "a", max_tokens=3000)
    monkeypatch.setattr(shards_module, "write_shard_file", real_write)
    resumed = _prepare(corpus, tokenizer, tmp_path / "a", max_tokens=3000)
    whole = _prepare(corpus, tokenizer, tmp_path / "b", max_tokens=3000)
    assert resumed.num_tokens == whole.num_tokens == 3000
    assert _shard_files(_shards_folder(tmp_path / "a")) == _shard_files(_shards_folder(tmp_path / "b"))


def test_settings_are_checked(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="shard_tokens must be positive, got 0"):
        prepare_token_shards(lambda start: None, tokenizer, tmp_path, description="x", shard_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be positive or None, got -1"):
        prepare_token_shards(lambda start: None, tokenizer, tmp_path, description="x", max_tokens=-1)


# Encodes with two worker processes, then stalls reading its next chunk, and says so: the test SIGKILLs it there.
_POOL_OWNER = """
import sys, time
import numpy as np
from spillway.data import load_tokenizer
from spillway.data.encoding import encode_chunks

def chunks():
    for _ in range(4):
        yield ["a document to encode"] * 8
    print("workers busy", flush=True)
    time.sleep(600)

for _ in encode_chunks(chunks(), load_tokenizer(sys.argv[1]), np.uint16, num_proc=2):
    pass
"""


def _processes_marked(marker: str) -> list[int]:
    """Pids of the processes whose environment holds `marker` (the child, its fork server, workers, tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads process environments from /proc")
def test_a_killed_runs_tokenizing_workers_do_not_outlive_it(tokenizer, tmp_path):
    """SIGKILL shuts no process pool down: the workers lived on for good, and with them the fork server and the
    resource tracker (they hold pipe ends the workers inherited), four processes of 100+ MB per killed run."""
    import time
    import uuid

    marker = f"SPILLWAY_POOL_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    child = subprocess.Popen([sys.executable, "-c", _POOL_OWNER, str(tokenizer.save(tmp_path / "t.model"))],
                             env={**os.environ, name: value}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "workers busy"
        deadline = time.monotonic() + 60
        while len(_processes_marked(marker)) < 4 and time.monotonic() < deadline:   # owner, server, 2 workers
            time.sleep(0.2)
        assert len(_processes_marked(marker)) >= 4
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 30
    while _processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_marked(marker)
    for pid in left:   # not left behind by the test either
        os.kill(pid, 9)
    assert left == []
