"""Chat/instruct preparation resumes after a kill: it tokenizes only the records after its last progress, and
its rows are those of a preparation never stopped."""

import numpy as np
import pytest

from spillway.data import sft_packing
from spillway.data.chat_template import resolve_chat_template
from spillway.data.sft_packing import SftOptions, prepare_sft_rows
from spillway.layers.errors import DataError

from test_sft_data import CharTokenizer, write_instruct

TOKENIZE = sft_packing.conversation_tokens
OPTIONS = SftOptions("instruct", seq_len=40, val_fraction=0.3)


def _template():
    return resolve_chat_template("spillway", None, {"bos_token": "<s>", "eos_token": "</s>"}, bos_first=True)


class Killed(BaseException):
    """The process dying mid-preparation (a BaseException, as KeyboardInterrupt is, which pytest keeps)."""


def _counting(monkeypatch, stop_at=None):
    """Counts the records tokenized; raises Killed at the `stop_at`-th."""
    calls = []
    tokenize = TOKENIZE

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at:
            raise Killed
        return tokenize(*args, **kwargs)
    monkeypatch.setattr(sft_packing, "conversation_tokens", counted)
    return calls


def test_a_killed_preparation_resumes_from_its_last_progress(tmp_path, monkeypatch):
    source = write_instruct(tmp_path / "d.jsonl", [f"answer {i} " + "z" * (i % 7) for i in range(20)])
    whole = prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=tmp_path / "whole")

    monkeypatch.setattr(sft_packing, "PROGRESS_EVERY", 4)
    calls = _counting(monkeypatch, stop_at=11)            # killed at record 11: progress saved after 4 and 8
    cache = tmp_path / "cache"
    with pytest.raises(Killed):
        prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=cache)
    (partial,) = (cache / "sft").glob(".*.partial")
    with open(partial / "train.tokens", "ab") as torn:    # what a SIGKILL leaves: bytes past the last progress
        torn.write(b"\x07" * 13)
    assert [p.name for p in (cache / "sft").iterdir() if p.is_dir()] == [partial.name]   # nothing final yet

    calls = _counting(monkeypatch)
    resumed = prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=cache)
    assert len(calls) == 20 - 8                           # records 9 to 20 only
    assert not resumed.from_cache and not partial.exists()
    assert np.array_equal(resumed.train, whole.train) and np.array_equal(resumed.val, whole.val)
    assert (resumed.num_tokens, resumed.num_documents) == (whole.num_tokens, whole.num_documents)
    calls.clear()
    again = prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=cache)
    assert again.from_cache and not calls


def test_a_bad_record_leaves_no_partial_folder(tmp_path):
    source = tmp_path / "d.jsonl"
    source.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "q"}\n')
    with pytest.raises(DataError):
        prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "sft").iterdir() if p.is_dir()]


def test_a_full_disk_while_the_rows_are_laid_out_names_the_folder_and_keeps_the_progress(tmp_path, monkeypatch):
    """The rows were written through a writable memory map, which a full disk answers with SIGBUS: the process
    died without a word ("Bus error"). Written with plain writes, the full disk is one error naming the folder, and
    the examples tokenized so far are kept for the rerun."""
    import errno

    from spillway.data import npy_stream

    source = write_instruct(tmp_path / "d.jsonl", [f"answer {i} " + "z" * (i % 7) for i in range(20)])
    whole = prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=tmp_path / "whole")

    def full(self, values):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(npy_stream.NpyStreamWriter, "append", full)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=rf"cannot write {cache / 'sft'}/\S+: no space left on its disk \(.* MiB "
                                        rf"free\); free space on that disk"):
        prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=cache)
    (partial,) = (cache / "sft").glob(".*.partial")
    assert (partial / sft_packing.PROGRESS).is_file()   # every example counted: the rerun only lays out the rows
    monkeypatch.undo()
    calls = _counting(monkeypatch)
    resumed = prepare_sft_rows(str(source), CharTokenizer(), _template(), OPTIONS, cache_dir=cache)
    assert not calls
    assert np.array_equal(resumed.train, whole.train) and np.array_equal(resumed.val, whole.val)
