"""From a recipe's DataConfig to tokenizer + packed rows + loaders (the glue between recipes and data/).

Process 0 trains the tokenizer and tokenizes first; the others wait at a
barrier and then load the cached results, so several processes never race on
the same cache files.
"""

from __future__ import annotations

from pathlib import Path

from spillway.data import (BatchLoader, PackedData, Tokenizer, check_vocab, load_tokenizer,
                           prepare_tokens, stream_documents, train_tokenizer)
from spillway.recipes.train import distributed
from spillway.recipes.config import Recipe


def load_or_train_tokenizer(recipe: Recipe) -> Tokenizer:
    cfg = recipe.data
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    # A stream: the tokenizer trains on the head of the corpus, which is never copied whole.
    documents = stream_documents(cfg.source, text_field=cfg.text_field, cache_dir=Path(cfg.cache_dir) / "datasets")
    return train_tokenizer(documents, vocab_size=recipe.model.vocab_size, model_type=cfg.tokenizer_type,
                           cache_dir=Path(cfg.cache_dir) / "tokenizers")


def prepare(recipe: Recipe) -> tuple[Tokenizer, PackedData]:
    """Tokenizer and packed rows for the recipe, computed once per cache key."""
    if recipe.data.mixture:
        # spillway.data prepares and loads mixtures (prepare_mixture, MixtureLoader); the train
        # loop's evaluation and logging still expect one corpus, so refuse rather than ignore it.
        raise ValueError(f"data.mixture={recipe.data.mixture!r}: training on a mixture is not wired into "
                         f"the train loop yet; use data.source")
    def build():
        tokenizer = load_or_train_tokenizer(recipe)
        check_vocab(tokenizer, recipe.model.vocab_size)
        # Packing ends every document with the EOS: a tokenizer without one fails here, saying where it looked.
        _ = tokenizer.eos_id
        packed = prepare_tokens(recipe.data.source, tokenizer, seq_len=recipe.data.seq_len,
                                cache_dir=recipe.data.cache_dir, val_fraction=recipe.data.val_fraction,
                                num_proc=recipe.data.num_proc, seed=recipe.train.seed,
                                text_field=recipe.data.text_field, max_tokens=recipe.data.max_tokens,
                                shard_tokens=recipe.data.shard_tokens)
        return tokenizer, packed

    if distributed.is_main_process():
        result = build()
        distributed.barrier("spillway-data-ready")
        return result
    distributed.barrier("spillway-data-ready")
    return build()


def train_loader(packed: PackedData, recipe: Recipe, process_index: int, process_count: int) -> BatchLoader:
    return BatchLoader(packed.train, global_batch_size=recipe.train.global_batch, seed=recipe.train.seed,
                       process_index=process_index, process_count=process_count)
