"""`python -m spillway.data`: train (or load) a tokenizer and pack a corpus, printing what each step cost.

Useful to measure a text corpus, and to warm the cache before a run (`spillway prepare RECIPE` prepares
any run's data as the run makes it: chat and instruct formats, mixtures, a named tokenizer):

    python -m spillway.data --source builtin:stdlib --vocab-size 2048 --seq-len 128   # the tiny recipe's rows

The defaults are a recipe's (recipes/config.py DataConfig: validation fraction,
cache folder, shard size), so the same source, vocabulary size and sequence
length prepare the rows a run started in the same folder reads, not a second
copy under another key.

The tokenizer trains on the head of the corpus, read as a stream; packing
tokenizes into shards on disk (`--shard-tokens`), so neither holds the corpus
in memory. A killed run, started again with the same arguments, resumes.

A corpus or setting that cannot be used (a binary file in a text corpus, a
malformed .jsonl line, a missing path) is one line on stderr and exit status 2,
as for the `spillway` command.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path

from spillway.layers.errors import DataError, SpillwayError

from .cache import DISK_FULL_ADVICE
from .corpus import BUILTIN_STDLIB
from .hub_reach import hub_unreachable_reason, local_copy_advice
from .packing import prepare_tokens
from .peak_memory import peak_rss_bytes
from .shards import DEFAULT_SHARD_TOKENS
from .sources import HUB_PREFIX, parse_hub_spec, source_notes, stream_documents
from .spm_tokenizer import MODEL_TYPES, train_tokenizer

PROG = "python -m spillway.data"
EXIT_USER_ERROR = 2   # the `spillway` command's status for a failure the user can fix (recipes/cli.py)
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports it
EXIT_INTERNAL_ERROR = 1   # as `spillway` exits on a bug


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a failure the user can fix is one line on stderr and EXIT_USER_ERROR, Ctrl-C one line
    and EXIT_INTERRUPTED (what is prepared so far is kept: the same command resumes)."""
    # Each step's line as it ends, also into a file: block-buffered, a log of a killed preparation was empty
    # after 50 of its 51 shards were written.
    if hasattr(sys.stdout, "reconfigure"):   # a file object; not a test's capture
        sys.stdout.reconfigure(line_buffering=True)
    try:
        prepare_and_report(argv)
    except KeyboardInterrupt:   # it was a traceback from inside sentencepiece
        print(f"{PROG}: interrupted (the shards written so far are kept: the same command resumes)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (SpillwayError, ValueError, OSError) as error:
        reason = (error.strerror if isinstance(error, OSError) and error.strerror and error.filename else None)
        message = f"{error.filename}: {reason}" if reason else " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            message += f"; {DISK_FULL_ADVICE}"
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as error:   # a bug: one line, as `spillway` says it; SPILLWAY_DEBUG=1 shows the traceback
        if os.environ.get("SPILLWAY_DEBUG", "") not in ("", "0"):
            raise
        message = " ".join(f"{type(error).__name__}: {error}".split())[:400]
        print(f"{PROG}: internal error, please report it: {message} (SPILLWAY_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command's options; defaults as a recipe's data section has them (module docstring)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=BUILTIN_STDLIB,
                        help="a local folder or file, a Hub dataset name, or builtin:stdlib (default: %(default)s)")
    parser.add_argument("--text-field", default="text", help="the records' text column (default: %(default)s)")
    parser.add_argument("--split", default="train",
                        help="the source's split: a Hub dataset's, a save_to_disk DatasetDict's, or a folder's "
                             "split-named files (train.jsonl + test.jsonl, data/train-*.parquet) (default: train)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="the tokenizer's vocabulary: the recipe's model.vocab_size (default: %(default)s)")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe",
                        help="sentencepiece model type: data.tokenizer_type (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="tokens a packed row: the recipe's data.seq_len (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="held out for validation (default: %(default)s)")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: threads here)")
    parser.add_argument("--max-tokens", type=int, default=None, help="take only the head of the source")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="tokens a cache shard (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the tokenizer's sample and the validation split's draw (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/spillway"),
                        help="where the tokenizer and rows go: data.cache_dir (default: %(default)s)")
    return parser


def check_hub_reachable(source: str) -> None:
    """DataError at once for a Hub source this machine cannot stream (offline, unknown, gated): one metadata
    request, where `datasets` would retry for half a minute before saying so."""
    hub = parse_hub_spec(source)
    reason = hub_unreachable_reason(hub) if hub is not None else None
    if reason is not None:
        what = (f"is the Hugging Face Hub dataset {hub.repo_id}" if source.startswith(HUB_PREFIX) else
                f"is no file or folder (relative to {os.getcwd()}), and as the Hugging Face Hub dataset "
                f"{hub.repo_id}")
        raise DataError(f"--source {source!r} {what}, streamed as it is read, {reason}: "
                        f"{local_copy_advice(hub, '--source DIR')}")


def prepare_and_report(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)

    # CPU time next to wall time: on a shared machine the wall clock mostly
    # measures the neighbours. (CPU time of num_proc workers is not counted.)
    clock = lambda: (time.perf_counter(), time.process_time())  # noqa: E731
    start = clock()
    check_hub_reachable(args.source)
    for line in source_notes(args.source, args.split):   # the split read, the files skipped
        print(line)
    documents = stream_documents(args.source, text_field=args.text_field, cache_dir=args.cache_dir / "datasets",
                                 split=args.split)
    loaded = clock()
    tokenizer = train_tokenizer(
        documents,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        cache_dir=args.cache_dir / "tokenizers",
        seed=args.seed,
    )
    trained = clock()
    packed = prepare_tokens(
        args.source,
        tokenizer,
        seq_len=args.seq_len,
        val_fraction=args.val_fraction,
        cache_dir=args.cache_dir,
        num_proc=args.num_proc,
        seed=args.seed,
        text_field=args.text_field,
        max_tokens=args.max_tokens,
        shard_tokens=args.shard_tokens,
        split=args.split,
    )
    done = clock()
    def cost(a, b):
        return f"{b[0] - a[0]:7.2f} s wall {b[1] - a[1]:7.2f} s cpu"

    print(f"load documents   {cost(start, loaded)}")
    print(f"tokenizer        {cost(loaded, trained)}  {tokenizer.path}")
    print(f"tokenize + pack  {cost(trained, done)}  {packed.path}{'  (cached)' if packed.from_cache else ''}")
    print(
        f"{packed.num_documents} documents, {packed.num_tokens} tokens; "
        f"train {packed.train.shape} val {packed.val.shape} {packed.train.dtype}"
    )
    print(f"peak RSS {peak_rss_bytes() / 1e6:.0f} MB (this process; worker processes not included)")


if __name__ == "__main__":
    sys.exit(main())
