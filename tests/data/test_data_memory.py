"""Peak memory of a preparation does not grow with the corpus (each measured in a fresh process).

The in-memory preparation this replaced grew by 93 MB from a 1.5 MB to a
9 MB corpus of this kind (3.1M more tokens, same settings); the corpora here
differ by about 2M tokens. Streamed into shards, the peaks were equal to the
byte. Measured under two precautions that keep the comparison about our
memory:

- both corpora hold documents of the same sizes (stdlib files up to 40 kB),
  so their largest chunk of text is alike;
- glibc's malloc is given a fixed mmap threshold. By default it raises the
  threshold as large blocks are freed and then serves them from a heap that
  keeps freed space: resident memory creeps up by 20-25 MB over the first
  ~20 MB of text, then stays flat (measured on a 30 MB corpus). A small
  corpus would still be inside that warm-up, a large one past it.
"""

import json
import os
import subprocess
import sys

from benchmarks.data_prep import write_corpus
from spillway.data import stream_documents, train_tokenizer

_CHILD = """
import json, resource, sys
from spillway.data import load_tokenizer, prepare_tokens
source, tokenizer, cache = sys.argv[1:]
packed = prepare_tokens(source, load_tokenizer(tokenizer), seq_len=256, cache_dir=cache, shard_tokens=1 << 18)
print(json.dumps({"tokens": packed.num_tokens, "rows": len(packed.train) + len(packed.val),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _prepare_in_child(source, tokenizer_path, cache, tmp_path) -> dict:
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
                   "MALLOC_MMAP_THRESHOLD_": "131072"}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(tokenizer_path), str(cache)],
                           env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


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
    # Generous: shards and chunks are the same size for both corpora, so only noise should differ.
    assert growth < 16e6, f"peak RSS grew by {growth / 1e6:.1f} MB for {extra_tokens / 1e6:.1f}M more tokens"
