"""spillway's data pipeline: corpus sources, tokenizers, tokenize-and-pack, resumable batches.

This package depends on numpy, `datasets`, `sentencepiece` and `tokenizers`
only (no JAX; of this project only `spillway.layers.errors`, the exception
base, which imports nothing), so data preparation runs anywhere, quickly.

    docs = load_documents("builtin:stdlib")
    tokenizer = train_tokenizer(docs, vocab_size=4096, cache_dir=".cache/data")
    packed = prepare_tokens("builtin:stdlib", tokenizer, seq_len=256, cache_dir=".cache/data")
    batches = BatchLoader(packed.train, global_batch_size=32, seed=0)

Preparation is out of core: the corpus is read as a stream, tokenized into
shards on disk (resumable after a kill) and packed from memory-mapped shards,
so its peak memory does not grow with the corpus. Mixtures of weighted
sources: `parse_mixture`, `prepare_mixture`, `MixtureLoader` (and
`interleave_documents`, to train one tokenizer on all of them).
"""

from .corpus import BUILTIN_STDLIB, DEFAULT_MAX_BYTES, default_corpus_files, stdlib_root
from .holdout import document_scores
from .loader import BatchLoader, eval_batches
from .mixture import MixtureComponent, MixtureLoader, interleave_documents, parse_mixture, prepare_mixture
from .packing import PackedData, prepare_tokens
from .shards import DEFAULT_SHARD_TOKENS, TokenShards, prepare_token_shards, token_dtype
from .sources import (
    HubSpec,
    LocalSpec,
    load_documents,
    parse_hub_spec,
    parse_local_spec,
    select_text_column,
    source_fingerprint,
    stream_documents,
)
from .hf_tokenizer import HFTokenizer
from .spm_tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SentencePieceTokenizer, train_tokenizer
from .tokenizer import (
    NoEosTokenError,
    Tokenizer,
    check_vocab,
    padded_vocab_size,
    tokenizer_file_in,
)
from .tokenizer_loader import check_no_tokens_added, load_tokenizer

__all__ = [
    "check_no_tokens_added",
    "BOS_ID",
    "BUILTIN_STDLIB",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SHARD_TOKENS",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "BatchLoader",
    "HFTokenizer",
    "HubSpec",
    "LocalSpec",
    "MixtureComponent",
    "MixtureLoader",
    "NoEosTokenError",
    "PackedData",
    "SentencePieceTokenizer",
    "TokenShards",
    "Tokenizer",
    "check_vocab",
    "default_corpus_files",
    "document_scores",
    "eval_batches",
    "interleave_documents",
    "load_documents",
    "load_tokenizer",
    "padded_vocab_size",
    "parse_hub_spec",
    "parse_local_spec",
    "parse_mixture",
    "prepare_mixture",
    "prepare_token_shards",
    "prepare_tokens",
    "select_text_column",
    "source_fingerprint",
    "stdlib_root",
    "stream_documents",
    "token_dtype",
    "tokenizer_file_in",
    "train_tokenizer",
]
