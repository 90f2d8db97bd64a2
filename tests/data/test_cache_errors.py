"""A damaged data cache is named, with how to rebuild it: never numpy's "mmap length is greater than file
size", and never (for token ids past the vocabulary) advice about diverged weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spillway.data import prepare_tokens
from spillway.layers.errors import DataError


def packed(text_folder, tokenizer, cache):
    return prepare_tokens(str(text_folder), tokenizer, seq_len=16, cache_dir=cache, val_fraction=0.2)


def test_a_truncated_packed_cache_is_named_with_the_folder_to_delete(text_folder, tokenizer, tmp_path):
    first = packed(text_folder, tokenizer, tmp_path)
    rows = first.path / "train.npy"
    rows.write_bytes(rows.read_bytes()[: rows.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"cache file {rows} is damaged, e.g. truncated .*delete {first.path} and "
                                        rf"run again to rebuild it"):
        packed(text_folder, tokenizer, tmp_path)


def test_a_truncated_token_shard_is_named_with_the_folder_to_delete(text_folder, tokenizer, tmp_path):
    first = packed(text_folder, tokenizer, tmp_path)
    shards_dir = json.loads((first.path / "meta.json").read_text())["shards"]
    shutil.rmtree(first.path)   # the packed rows are rebuilt from the shards, which are read again
    shard = sorted(p for p in Path(shards_dir).glob("*.npy") if "tokens" in p.name)[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"cache file {shard} is damaged.*delete {shards_dir} and run again"):
        packed(text_folder, tokenizer, tmp_path)
