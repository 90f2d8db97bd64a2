"""Encode a stream of documents chunk by chunk, in this process or in worker processes.

Documents are read in chunks of a few megabytes of text; each chunk becomes
one flat token array (every document followed by EOS, and preceded by the BOS
when the tokenizer adds one: `Tokenizer.adds_bos`) and the length of each
document in it. Chunks come back in corpus order, whatever the number of
processes, so what is written downstream never depends on the parallelism.

- `num_proc` None or 1: this process encodes, with a sentencepiece thread per
  core (no process start-up, nothing pickled).
- `num_proc` > 1: a pool of that many worker processes, one thread each; this
  process reads the next chunks while the workers encode. At most two chunks
  per worker are in flight, so memory stays bounded when reading outpaces
  encoding. The pool uses the "forkserver" start method: forking a process
  that already runs JAX's threads (a training run) can deadlock the child.
  Each worker exits when the process that made the pool dies (a SIGKILL
  shuts no pool down), and the fork server and resource tracker with them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from .tokenizer import Tokenizer

# Text per chunk: large enough that per-call overheads vanish (sentencepiece
# starts its threads per call; tens of documents), small enough that a
# chunk's Python token lists (about 36 bytes a token) stay a few MB.
DEFAULT_CHUNK_CHARS = 250_000
_MAX_CHUNK_DOCUMENTS = 4096
# A document longer than this is encoded in pieces where the tokenizer allows it (`encode_texts`): a 40 MB
# one-line document encoded whole peaked at 2.3 GB (sentencepiece's work space and 36 bytes a Python int).
LONG_DOCUMENT_CHARS = 1_000_000
_IN_FLIGHT_PER_WORKER = 2


def text_chunks(documents, *, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[list[str]]:
    """Lists of consecutive document texts of about `chunk_chars` characters (a document is never split).

    `documents` is a `datasets` dataset or stream with a "text" column.
    """
    chunk: list[str] = []
    size = 0
    for batch in documents.iter(batch_size=256):
        for text in batch["text"]:
            chunk.append(text)
            size += len(text)
            if size >= chunk_chars or len(chunk) >= _MAX_CHUNK_DOCUMENTS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def pieces_before_spaces(text: str, limit: int) -> list[str]:
    """`text` cut into pieces of at most about `limit` characters, each cut just before a single space that
    sits between two non-space characters (a piece longer than `limit` remains where there is no such space)."""
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = text.rfind(" ", start + 1, start + limit)
        while cut > start and (text[cut - 1].isspace() or cut + 1 >= len(text) or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:   # no safe cut in this window: the next one past it
            cut = next((i for i in range(start + limit, len(text) - 1)
                        if text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace()), -1)
            if cut < 0:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _encode_one_long(tokenizer: Tokenizer, text: str, dtype: np.dtype, num_threads: int) -> list[int] | np.ndarray:
    """A document of more than LONG_DOCUMENT_CHARS characters, in pieces (same ids: the tokenizer says so), each
    piece's Python ints turned into a compact array at once: memory is bounded by a piece, not the document."""
    return np.concatenate([np.asarray(tokenizer.encode([piece], num_threads=num_threads)[0], dtype=dtype)
                           for piece in pieces_before_spaces(text, LONG_DOCUMENT_CHARS)])


def encode_texts(
    tokenizer: Tokenizer, texts: list[str], dtype: np.dtype, *, num_threads: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): the documents' ids, each after the BOS (if the tokenizer adds one) and followed by
    EOS, flat; the length of each with its BOS and EOS."""
    prefix = tokenizer.document_prefix()
    if tokenizer.splits_exactly_before_spaces and any(len(text) > LONG_DOCUMENT_CHARS for text in texts):
        parts = [np.concatenate([np.asarray(prefix, dtype), _encode_one_long(tokenizer, text, dtype, num_threads),
                                 np.asarray([tokenizer.eos_id], dtype)]).astype(dtype)
                 if len(text) > LONG_DOCUMENT_CHARS else
                 np.asarray(prefix + tokenizer.encode([text], num_threads=num_threads)[0] + [tokenizer.eos_id],
                            dtype=dtype)
                 for text in texts]
        return np.concatenate(parts), np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    encoded = tokenizer.encode(texts, num_threads=num_threads)
    eos = tokenizer.eos_id
    if prefix:
        encoded = [prefix + ids for ids in encoded]
    for ids in encoded:
        ids.append(eos)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    tokens = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum()))
    return tokens, lengths


# State of a pool worker: set once by `_start_worker`, so the tokenizer is
# pickled once per worker rather than once per chunk. Every Tokenizer
# (sentencepiece or tokenizer.json) pickles itself (data/tokenizer.py).
_worker_tokenizer: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _start_worker(tokenizer: Tokenizer, dtype: str, pool_owner: int) -> None:
    global _worker_tokenizer, _worker_dtype
    _worker_tokenizer = tokenizer
    _worker_dtype = np.dtype(dtype)
    threading.Thread(target=_exit_when_gone, args=(pool_owner,), daemon=True, name="spillway-owner-watch").start()


def _exit_when_gone(pid: int) -> None:
    """Ends this worker when the process that made the pool is gone. A SIGKILLed run shuts no pool down, and
    its workers lived on for good, and with them the fork server and the resource tracker (each holds a pipe
    end the workers inherited): four processes of 100+ MB per killed run. A pidfd wakes at the owner's exit
    (Linux 5.3+); elsewhere a once-a-second check."""
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):   # not Linux, an old kernel, or the owner already gone
        handle = None
    if handle is not None:
        select.select([handle], [], [])
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:   # alive, another user's pid: cannot be ours, but do not guess
                pass
            time.sleep(1.0)
    os._exit(1)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tokenizer, texts, _worker_dtype, num_threads=1)


def encode_chunks(
    chunks: Iterable[list[str]], tokenizer: Tokenizer, dtype: np.dtype, *, num_proc: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`encode_texts` of every chunk, in order; see the module docstring for `num_proc`.

    Closing the iterator early (a token cap reached) stops the workers.
    """
    dtype = np.dtype(dtype)
    if not num_proc or num_proc <= 1:
        threads = os.cpu_count() or 1
        for texts in chunks:
            yield encode_texts(tokenizer, texts, dtype, num_threads=threads)
        return
    context = multiprocessing.get_context("forkserver")
    # The fork server imports this module once and every worker inherits it,
    # instead of each worker importing `datasets` and the rest anew.
    context.set_forkserver_preload([__name__])
    # A process pool that fails loudly: a worker that dies (killed, out of memory) or cannot start
    # raises BrokenProcessPool here, where multiprocessing.Pool would wait for its result forever.
    pool = concurrent.futures.ProcessPoolExecutor(num_proc, mp_context=context, initializer=_start_worker,
                                                  initargs=(tokenizer, dtype.str, os.getpid()))
    try:
        pending: collections.deque = collections.deque()
        for texts in chunks:
            pending.append(pool.submit(_encode_in_worker, texts))
            if len(pending) >= _IN_FLIGHT_PER_WORKER * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
