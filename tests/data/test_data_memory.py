"""Peak memory of a preparation does not grow with the corpus (each measured in a fresh process).

On the two corpora of this test (1 MB and 6 MB of stdlib files up to 40 kB,
0.39M and 2.45M tokens) the in-memory preparation this replaced peaked at
203 MB and 305 MB; the sharded one at 163 MB and 168 MB, and at 171 MB on a
30 MB corpus of 12M tokens: what remains is allocator warm-up and the list of
files, not a cost per token. Both corpora hold documents of the same sizes,
so their largest chunk of text is alike.
"""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.data_prep import write_corpus
from spillway.data import stream_documents, train_tokenizer

# The child's own peak (VmHWM): its ru_maxrss would include this test process's
# peak, which Linux carries over from the fork across exec.
_CHILD = """
import json, sys
from spillway.data import load_tokenizer, prepare_tokens
from spillway.data.peak_memory import peak_rss_bytes
source, tokenizer, cache = sys.argv[1:]
packed = prepare_tokens(source, load_tokenizer(tokenizer), seq_len=256, cache_dir=cache, shard_tokens=1 << 18)
print(json.dumps({"tokens": packed.num_tokens, "rows": len(packed.train) + len(packed.val),
                  "peak_rss": peak_rss_bytes()}))
"""


def _prepare_in_child(source, tokenizer_path, cache, tmp_path) -> dict:
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(tokenizer_path), str(cache)],
                           env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_peak_memory_stays_flat_as_the_corpus_grows(tmp_path):
    write_corpus(tmp_path / "small", 1_000_000, max_file_bytes=40_000)
    write_corpus(tmp_path / "large", 6_000_000, max_file_bytes=40_000)
    tokenizer = train_tokenizer(stream_documents(str(tmp_path / "small")), vocab_size=1024)
    tokenizer_path = tokenizer.save(tmp_path / "tokenizer.model")
    small = _prepare_in_child(tmp_path / "small", tokenizer_path, tmp_path / "cache-small", tmp_path)
    large = _prepare_in_child(tmp_path / "large", tokenizer_path, tmp_path / "cache-large", tmp_path)
    assert large["tokens"] > 5 * small["tokens"] > 5 * 200_000
    growth = large["peak_rss"] - small["peak_rss"]
    extra_tokens = large["tokens"] - small["tokens"]
    # Generous (4x what was measured), and a fifth of what the in-memory preparation needed.
    assert growth < 20e6, f"peak RSS grew by {growth / 1e6:.1f} MB for {extra_tokens / 1e6:.1f}M more tokens"
