"""Shared fixtures for the data tests: tiny corpora on disk and one tiny tokenizer.

The Hugging Face libraries are put in offline mode before they are imported,
so no test can reach the network (local builders never need it), and their
default cache points into pytest's temporary directory, so no test writes
under the user's home.
"""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import datasets  # noqa: E402
import pytest  # noqa: E402

from spillway.data import train_tokenizer  # noqa: E402
from tiny_corpus import make_documents  # noqa: E402

datasets.disable_progress_bars()


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache_in_tmp(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets"))
        yield


@pytest.fixture
def text_folder(tmp_path):
    """A folder of 12 .txt/.md/.py documents (one nested), plus files that must be ignored."""
    folder = tmp_path / "corpus"
    (folder / "nested").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    suffixes = [".txt", ".md", ".py"]
    for index, text in enumerate(make_documents(12)):
        parent = folder / "nested" if index == 11 else folder
        (parent / f"doc{index:02d}{suffixes[index % 3]}").write_text(text)
    (folder / ".hidden" / "secret.txt").write_text("never part of the corpus")
    (folder / "image.png").write_bytes(b"\x89PNG not text")
    return folder


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A 400-piece BPE tokenizer with byte fallback, trained once per session."""
    return train_tokenizer(
        make_documents(60, seed=1),
        vocab_size=400,
        cache_dir=tmp_path_factory.mktemp("tokenizers"),
    )
