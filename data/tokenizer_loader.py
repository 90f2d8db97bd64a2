"""`load_tokenizer`: a tokenizer of either kind from a file or a directory (data/tokenizer.py says which file wins).

Apart from data/tokenizer.py, which defines the interface both kinds implement, so that no module imports
back the module that imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .hf_tokenizer import HFTokenizer
from .spm_tokenizer import SentencePieceTokenizer
from .tokenizer import TOKENIZER_FILES, Tokenizer, added_token_ids, read_special_tokens, tokenizer_file_in


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a `.json` file (Hugging Face), any other file (sentencepiece), or a directory holding
    tokenizer.json or tokenizer.model. Special tokens come from the files beside it (data/tokenizer.py)."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = tokenizer_file_in(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no tokenizer: neither {' nor '.join(TOKENIZER_FILES)}")
        path = found
    elif not path.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist")
    special = read_special_tokens(path.parent)
    if path.suffix == ".json":
        return HFTokenizer.from_file(path, special)
    return SentencePieceTokenizer.from_file(path, special)


def check_no_tokens_added(tokenizer: Tokenizer) -> None:
    """ValueError for a sentencepiece model whose folder adds tokens that are not its pieces (a ChatML
    `<|im_end|>` after a Llama 2 vocabulary): transformers matches them in every text and gives them their own
    ids; read as the model alone, they were split into characters, and a chat template's turns trained on
    other ids than transformers gives. For a tokenizer a new run is given: a run that started before this check
    goes on (resumes, samples, exports) with the tokenization it trained with."""
    if not isinstance(tokenizer, SentencePieceTokenizer) or tokenizer.path is None:
        return
    path, processor = tokenizer.path, tokenizer.processor
    added = {text: token_id for text, token_id in added_token_ids(path.parent).items()
             if not (0 <= token_id < processor.get_piece_size() and processor.id_to_piece(token_id) == text)}
    if added:
        named = ", ".join(f"{text!r} as {token_id}" for text, token_id in sorted(added.items(), key=lambda kv: kv[1]))
        raise ValueError(
            f"{path}: the files beside it add tokens that are not pieces of the sentencepiece model ({named}; the "
            f"model has {processor.get_piece_size()} pieces): spillway reads a sentencepiece tokenizer's own pieces "
            f"only, so their ids would differ from transformers'. Point data.tokenizer at the tokenizer.json "
            f"transformers writes for this folder (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes "
            f"one; a folder holding both is read through tokenizer.json)")
