"""A single very long document (a 40 MB one-line file) is encoded in pieces, so preparing it does not take
tens of times its size in memory (it peaked at 2.0 GB, 50x the document; 0.42 GB now), and the pieces give
exactly the ids of the whole."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np

from spillway.data import default_corpus_files
from spillway.data import encoding

_CHILD = """
import json, sys
from spillway.data import load_tokenizer, prepare_tokens
from spillway.data.peak_memory import peak_rss_bytes
source, tokenizer, cache = sys.argv[1:]
loaded = load_tokenizer(tokenizer)
base = peak_rss_bytes()
packed = prepare_tokens(source, loaded, seq_len=64, cache_dir=cache, val_fraction=0.0)
print(json.dumps({"tokens": packed.num_tokens, "base": base, "peak": peak_rss_bytes()}))
"""


def test_a_long_document_in_pieces_gives_the_ids_of_the_whole(tokenizer, monkeypatch):
    assert tokenizer.splits_exactly_before_spaces   # the kind train_tokenizer makes
    # source code: indentation, runs of spaces, newlines, tabs; cut every ~2000 characters
    text = "".join(path.read_text(encoding="utf-8", errors="replace") for path in default_corpus_files(300_000))
    text = text.replace("\n", " ") + " " + text   # a one-line part and a many-line part
    monkeypatch.setattr(encoding, "LONG_DOCUMENT_CHARS", 2000)
    assert len(encoding.pieces_before_spaces(text, 2000)) > 100
    tokens, lengths = encoding.encode_texts(tokenizer, ["short one", text], np.dtype(np.uint16))
    whole = [tokenizer.encode(["short one"])[0] + [tokenizer.eos_id], tokenizer.encode([text])[0] + [tokenizer.eos_id]]
    assert lengths.tolist() == [len(ids) for ids in whole]
    assert tokens.tolist() == whole[0] + whole[1]


def test_preparing_one_long_one_line_document_takes_a_few_times_its_size(tokenizer, tmp_path):
    rng = random.Random(0)
    words = "def return class import self value index print while lambda yield".split()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    document = corpus / "one.txt"
    document.write_text(" ".join(rng.choice(words) for _ in range(10_000_000 // 6)))
    tokenizer_path = tokenizer.save(tmp_path / "tokenizer.model")
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(tokenizer_path), str(tmp_path / "cache")],
                           env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    grown = result["peak"] - result["base"]
    # encoded whole: about 45x the document (10 MB -> 0.45 GB); in pieces about 10x
    assert grown < 15 * document.stat().st_size, f"{grown / 1e6:.0f} MB for a {document.stat().st_size / 1e6:.0f} MB document"
