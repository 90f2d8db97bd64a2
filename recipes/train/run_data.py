"""The data phase of a run: its tokenizer and packed rows, with what the run says of them (the mixture that
replaces data.source, chat settings a text run does not read, the split and skipped files, the BOS rule a
resume keeps, a template without an end of turn). The train loop runs it (recipes/train/loop.py), and
`spillway prepare` runs it alone (recipes/train/prepare_ahead.py)."""

from __future__ import annotations

import time

from spillway.layers.residency import host_layers, is_param_split
from spillway.recipes.config import DataConfig, Recipe


def _chat_settings_unread(data: DataConfig) -> list[str]:
    """The chat/instruct settings a text run was given away from their defaults (they were ignored unsaid)."""
    if data.format != "text":
        return []
    defaults = DataConfig()
    return [f"data.{name}={getattr(data, name)}" for name in ("chat_template", "train_on_prompt", "packing", "overlong")
            if getattr(data, name) != getattr(defaults, name)]


def placement_said(setting: str, num_layers: int) -> str:
    """An offload placement as the run's first line says it: a split with the layers it comes to, since a
    fraction rounds (host:0.01 of 32 layers is one layer, 3%, not 1%)."""
    if not is_param_split(setting):
        return setting
    return f"{setting} (the last {host_layers(setting, num_layers)} of {num_layers} block layers)"


def prepare_run_data(recipe: Recipe, own_tokenizer, kept_bos, say, resuming: bool = False):
    """(tokenizer, data_pipeline.TrainingData), with what the run is saying about them; `resuming`: the run
    resumes a step of its own."""
    from spillway.data import load_tokenizer
    from spillway.models.hf import config_refusal
    from spillway.recipes.train import lora_state
    from spillway.recipes.train.data_pipeline import end_of_turn_warning, prepare, source_notes_of
    from spillway.recipes.train.tokenization_record import describe_kept_bos

    block = f", block {recipe.block}" if recipe.block else ""   # a user's block, named where the run starts
    say(f"recipe {recipe.name} ({recipe.family}{block}): {recipe.num_params() / 1e6:.2f}M parameters, "
        f"activations: {recipe.offload.activations}, "
        f"optimizer state: {placement_said(recipe.offload.optimizer_state, recipe.model.num_layers)}"
        + ("" if recipe.offload.params == "device" else
           f", weights: {placement_said(recipe.offload.params, recipe.model.num_layers)}"))
    if recipe.lora.enabled:
        say(lora_state.trained_summary(recipe))
    if (refusal := config_refusal(recipe.without_adapters().model)) is not None:
        say(f"warning: spillway export will refuse this model, so the run cannot become a Hugging Face folder: "
            f"{refusal.rstrip('.')}. Its checkpoints, resume and spillway generate are unaffected")
    if (unread_source := mixture_replaces(recipe)) is not None:
        say(f"warning: data.mixture is set, so data.source={unread_source} is not read (a mixture replaces "
            f"it; list that source in the mixture to train on it)")
    unread = _chat_settings_unread(recipe.data)
    if unread:
        say(f"warning: data.format=text, so {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not read (they "
            f"shape chat/instruct rows: set data.format=chat or instruct to fine-tune on conversations)")
    # Said first: a large corpus takes minutes to tokenize the first time, and nothing else is said meanwhile.
    # (before the cache is looked at: the line after the data says "cached" or "tokenized")
    say(f"data: {recipe.data.mixture or recipe.data.source} (tokenized on first use into {recipe.data.cache_path}, "
        f"read from there after)")
    for line in source_notes_of(recipe):   # the split read and the files skipped: nothing left out unsaid
        say(line)
    t0 = time.perf_counter()
    tokenizer, data = prepare(recipe, load_tokenizer(own_tokenizer) if own_tokenizer is not None else None,
                              bos=kept_bos, resuming=resuming)
    if kept_bos is not None and (line := describe_kept_bos(tokenizer, kept_bos, recipe.data.add_bos)):
        say(line)
    if recipe.data.format != "text" and (line := end_of_turn_warning(recipe, tokenizer)):
        say(line)
    say(f"data: {data.describe()} ({'cached' if data.from_cache else 'tokenized'}, "
        f"{time.perf_counter() - t0:.1f}s); tokenizer vocab {tokenizer.vocab_size}")
    return tokenizer, data


def mixture_replaces(recipe: Recipe) -> str | None:
    """The data.source a mixture leaves unread where the user set it; None for the default's or the one a
    registered recipe names itself (tiny_sft's instruction set), which the user never set."""
    from spillway.recipes.registry import get_recipe, recipe_names

    if not recipe.data.mixture or recipe.data.source == DataConfig.source:
        return None
    if recipe.name in recipe_names() and get_recipe(recipe.name).data.source == recipe.data.source:
        return None
    return recipe.data.source
