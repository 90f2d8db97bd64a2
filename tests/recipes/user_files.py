"""Files a user brings to a run, made for a test: the micro recipe's corpus as a local folder, a tokenizer.json.

`copy_stdlib_corpus` makes the micro recipe's (tests/micro_recipe.py) built-in
corpus a local text folder that a test can edit.
"""

from __future__ import annotations

import json
from pathlib import Path


EOS = "<|endoftext|>"
BOS = "<|begin|>"


def copy_stdlib_corpus(folder: Path, max_bytes: int = 400_000) -> Path:
    """The micro recipe's built-in corpus as a local folder of .py files (one document each), to edit."""
    from spillway.data import default_corpus_files

    folder.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(default_corpus_files(max_bytes)):
        (folder / f"{i:03d}_{path.name}").write_bytes(path.read_bytes())
    return folder


def write_hf_tokenizer(directory: Path, vocab_size: int = 300, other_specials: tuple[str, ...] = ()) -> Path:
    """A byte-level BPE tokenizer.json (trained here) and the tokenizer_config.json naming its EOS and BOS;
    `other_specials` are special tokens after them (a chat template's markers)."""
    from spillway.data import default_corpus_files
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS, *other_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in default_corpus_files(100_000)]
    tokenizer.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": BOS}))
    return directory
