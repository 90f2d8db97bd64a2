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


def test_a_full_disk_names_the_file_and_what_is_free(tmp_path, monkeypatch):
    """NumPy's short write says "100037 requested and 26560 written", the OS "No space left on device": with
    no path and no advice. Each is one DataError naming the file, the bytes and what to do."""
    import errno

    import numpy as np

    from spillway.data import cache

    def short_write(file, array):
        raise OSError(f"{array.size} requested and 3 written")

    monkeypatch.setattr(cache.np, "save", short_write)
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 20, 10 << 20, 1024))
    final = tmp_path / "shard.npy"
    with pytest.raises(DataError, match=rf"cannot write {final} \(0.8 MiB\): no space left on its disk \(0.0 MiB "
                                        rf"free\); free space on that disk, or write to another \(the data cache"):
        cache.atomic_write_array(final, np.zeros(200_000, np.int32))
    assert list(tmp_path.iterdir()) == []   # nothing half-written left

    def full(data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", lambda self, data: full(data))
    with pytest.raises(DataError, match=rf"cannot write {tmp_path / 'tok.model'} .*data.cache_dir"):
        cache.atomic_write_bytes(tmp_path / "tok.model", b"x" * 10)
    # another write failure (not for want of space) stays the OS's own error
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 0, 10 << 30))
    monkeypatch.setattr(cache.np, "save", lambda file, array: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        cache.atomic_write_array(final, np.zeros(4, np.int32))


def test_a_full_disk_while_packing_rows_names_the_rows_folder(text_folder, tokenizer, tmp_path, monkeypatch):
    """The rows are written through buffered file writes, whose ENOSPC (raised at a write or at close) names no
    file: the run said "No space left on device; free space on that disk" without saying which disk."""
    import errno

    from spillway.data import npy_stream

    def full(self, values):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(npy_stream.NpyStreamWriter, "append", full)
    with pytest.raises(DataError, match=rf"cannot write {tmp_path / 'packed'}/\S+ \(.* MiB\): no space left on its "
                                        rf"disk \(.* MiB free\); free space on that disk.*data.cache_dir"):
        packed(text_folder, tokenizer, tmp_path)
    assert [p for p in (tmp_path / "packed").iterdir() if not p.name.endswith(".lock")] == []   # nothing half-written
    monkeypatch.undo()
    assert packed(text_folder, tokenizer, tmp_path).path.parent == tmp_path / "packed"   # the rerun completes
