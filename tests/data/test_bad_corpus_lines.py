"""A .jsonl line that `datasets` cannot read, and a corpus that is not text: one line naming the file (and line).

Line 301 of each corpus here is bad in one of the ways pyarrow (the json
builder's parser) refuses, which it reports as "in row 300" of a block, with
two ERROR log lines; the stream fails only when it reaches that line. The
command `python -m spillway.data` (README) ends with one line and exit 2.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from spillway.data import stream_documents
from spillway.data.__main__ import main as data_main
from spillway.layers.errors import DataError

GOOD = b"".join((json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n").encode() for i in range(300))
BAD_LINES = {
    "not UTF-8 (byte 0xff": b'{"text": "bad \xff\xfe bytes"}\n',
    "not valid JSON (Unterminated string": b'{"text": "unterminated}\n',
    "not valid JSON (Invalid control character": b'{"text": "a\tb"}\n',
    "a string holds a lone UTF-16 surrogate": b'{"text": "a \\ud800 b"}\n',
    # a file joined with `cat` from files that each opened with a BOM: pyarrow reads the first one only
    "a UTF-8 byte order mark (BOM) opens it": b'\xef\xbb\xbf{"text": "joined"}\n',
}


def write_corpus(path, bad_line: bytes):
    path.write_bytes(GOOD + bad_line + b'{"text": "ok"}\n')
    return path


@pytest.mark.parametrize("problem", list(BAD_LINES))
def test_a_stream_names_the_file_and_the_1_based_line_without_log_lines(problem, tmp_path, caplog, capfd):
    corpus = write_corpus(tmp_path / "badline.jsonl", BAD_LINES[problem])
    documents = stream_documents(str(corpus), cache_dir=tmp_path / "datasets")
    with caplog.at_level(logging.INFO), pytest.raises(DataError) as raised:
        for _ in documents.iter(batch_size=64):
            pass
    assert str(raised.value).startswith(f"corpus file {str(corpus)!r}, line 301: {problem}")
    assert "\n" not in str(raised.value)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]   # no "Failed to load JSON" lines
    assert "Failed to load JSON" not in capfd.readouterr().err


def test_the_data_command_names_a_bad_jsonl_line_in_one_line_and_exits_2(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "badline.jsonl", BAD_LINES["not UTF-8 (byte 0xff"])
    assert data_main(["--source", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--vocab-size", "400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m spillway.data: error: corpus file {str(corpus)!r}, line 301: not UTF-8 (byte 0xff "
                   f"at column 15); re-encode the file to UTF-8 (for cp1252/Latin-1: iconv -f cp1252 -t utf-8)"]


def test_a_last_line_cut_short_says_the_file_looks_cut_short(tmp_path):
    corpus = tmp_path / "cut.jsonl"
    corpus.write_bytes(GOOD + b'{"text": "the download stopped he')   # no newline: the file ends mid-record
    with pytest.raises(DataError, match=r"line 301: not valid JSON \(Unterminated string .*\); it is the file's "
                                        r"last line, without a newline: the file looks cut short"):
        for _ in stream_documents(str(corpus), cache_dir=tmp_path / "datasets").iter(batch_size=64):
            pass
    # a bad line in the middle is no sign of a cut: no such advice
    write_corpus(corpus, BAD_LINES["not valid JSON (Unterminated string"])
    with pytest.raises(DataError) as raised:
        for _ in stream_documents(str(corpus), cache_dir=tmp_path / "datasets2").iter(batch_size=64):
            pass
    assert "cut short" not in str(raised.value)


def test_the_data_command_on_a_corpus_that_is_not_text_says_one_line_and_exits_2(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    (corpus / "b.txt").write_bytes(b"\x00\x01binary\x00" * 50)
    done = subprocess.run([sys.executable, "-m", "spillway.data", "--source", str(corpus), "--cache-dir",
                           str(tmp_path / "cache")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"python -m spillway.data: error: corpus file {corpus / 'b.txt'} is not text (100 NUL bytes): a text corpus "
        f"holds UTF-8 .txt/.py/.md files; remove it from the corpus, or point data.source at a folder without it"]
    assert "Traceback" not in done.stderr
