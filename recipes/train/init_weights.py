"""A fine-tune's first weights: `checkpoint.init_from`, from another spillway run or a Hugging Face checkpoint.

    checkpoint.init_from=runs/base                    a spillway run directory (latest step) or one step folder
    checkpoint.init_from=hf:/models/Llama-3.2-1B      a Hugging Face directory: config.json + *.safetensors

Only weights are read: optimizer state, schedule and data position start
fresh. They go straight into the shardings of the run's parameters (orbax for
spillway runs, models/hf.py `load_hf_weights` for Hugging Face), so no host
ever holds a whole replicated copy.

A spillway run of another family is refused in one line naming both families
(its saved recipe says which), before anything is built; one of another
model, every model field that differs, as a Hugging Face checkpoint's
config.json is held against the recipe below. A Hugging Face
checkpoint is checked against the recipe before anything is built
(`resolve_init_from`; its tensors' names and shapes by `check_hf_tensors`,
from the safetensors headers, no data read): its config.json is read as a family config
(models/hf.py `family_config_from_hf`) and must be the recipe's model, field
by field; the first difference is an error naming the field and both values.
One field may differ: `max_seq_len` (config.json's max_position_embeddings),
which only bounds the positions the run feeds: RoPE is computed, not learned,
so fine-tuning at a shorter length than the checkpoint's, or a longer one
(context extension, announced), loads the same tensors. A family that learns a
table of position embeddings (DecoderSpec.learned_positions) sizes that table
by it, and there it must match too. Everything else (sizes, vocabulary, RoPE
theta and scaling, norm epsilon, tied embeddings) changes either a tensor's
shape or the function the weights compute, so it must be equal.

Tokenizer: when the recipe names none (`data.tokenizer`), the checkpoint's
own is used (tokenizer.json, else tokenizer.model, in the same directory);
a tokenizer trained on the corpus would not match the checkpoint's embedding
rows, so a checkpoint without one is an error unless the recipe names one.

A full fine-tune that resumes from a step of its own reads neither: its step holds the whole model and its
run folder the tokenizer it trained with, so the `hf:` folder may have been moved or removed since it started
(the recipe keeps naming it, as it was saved; recipes/train/resume.py `resumes_from_own_step`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from spillway.data import tokenizer_file_in
from spillway.models.hf import family_config_from_hf, is_hf_checkpoint_folder, load_hf_weights, read_hf_config
from spillway.models.registry import get_family
from spillway.recipes.config import Recipe
from spillway.recipes.train.checkpoint import (CheckpointError, read_recipe_json, resolve_step_dir,
                                               restore_params_only)
from spillway.recipes.train.resume import resumes_from_own_step

HF_PREFIX = "hf:"
# Model fields that only bound the positions a run feeds (see the module docstring).
POSITION_RANGE_FIELDS = ("max_seq_len",)


def hf_checkpoint_dir(init_from: str | None) -> Path | None:
    """The directory of an `hf:` init_from, or None for anything else."""
    if not init_from or not init_from.startswith(HF_PREFIX):
        return None
    path = init_from[len(HF_PREFIX):].strip()
    if not path:
        raise ValueError(f"checkpoint.init_from={init_from!r}: name the checkpoint directory after 'hf:'")
    return Path(path).expanduser()


def check_model_matches(recipe: Recipe, directory: Path):
    """The checkpoint's model config; ValueError naming the family, or the first model field, in which the
    recipe and the checkpoint differ."""
    from spillway.models.hf_sources import safetensors_files

    where = f"checkpoint.init_from=hf:{directory}"
    try:
        family, checkpoint_model = family_config_from_hf(read_hf_config(directory))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{where}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if family.name != recipe.family:
        raise ValueError(f"{where}: the checkpoint is a {family.name} model, but recipe {recipe.name!r} builds "
                         f"a {recipe.family} model; pick a {family.name} recipe")
    try:
        safetensors_files(directory)   # a folder of config and tokenizer alone: named before anything else
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{where}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    differing = _differing_model_fields(recipe, checkpoint_model)
    if differing:
        _check_weights_agree_with_their_config(recipe, directory, family, checkpoint_model, where)
        what, flags = _model_differences(recipe, checkpoint_model, differing, "checkpoint")
        raise ValueError(f"{where}: recipe {recipe.name!r} differs from the checkpoint's config.json in {what}; "
                         f"match it with {flags}, or pick the recipe of this checkpoint")
    return checkpoint_model


def _differing_model_fields(recipe: Recipe, source_model) -> list[str]:
    """The model fields in which the recipe's model and the one the weights were trained as differ, but for those
    that only bound the positions a run feeds (the module docstring)."""
    may_differ = () if recipe.decoder_spec().learned_positions else POSITION_RANGE_FIELDS
    return [field.name for field in dataclasses.fields(recipe.model) if field.name not in may_differ
            and getattr(recipe.model, field.name) != getattr(source_model, field.name)
            and _effective(recipe.model, field.name) != _effective(source_model, field.name)]


def _model_differences(recipe: Recipe, source_model, differing: list[str], source: str) -> tuple[str, str]:
    """(the differing fields with both values, the --set flags that match the source): every field at once, with
    the flags that match it: one at a time took a user four runs."""
    what = ", ".join(f"model.{name} (recipe {_effective(recipe.model, name)!r}, {source} "
                     f"{_effective(source_model, name)!r})" for name in differing)
    flags = " ".join(flag for name in differing for flag in _set_flags(f"model.{name}",
                                                                      _effective(source_model, name)))
    return what, flags


def _check_weights_agree_with_their_config(recipe: Recipe, directory: Path, family, checkpoint_model,
                                           where: str) -> None:
    """A checkpoint whose config.json contradicts its own tensors (vocab_size 600, an embedding of 512 rows) is
    named as such: the flags matching its config would only lead to the shape mismatch after them."""
    from spillway.models.hf import HFCheckpointError, NoOutputHeadError, check_checkpoint_tensors
    from spillway.recipes.train.step import abstract_model

    _, abstract_state = abstract_model(dataclasses.replace(recipe.without_adapters(), model=checkpoint_model))
    try:
        check_checkpoint_tensors(directory, family, checkpoint_model, abstract_state)
    except NoOutputHeadError as error:   # no config.json makes weights without a head a causal LM's
        raise HFCheckpointError(f"{where}: {error}") from None
    except HFCheckpointError as error:
        raise HFCheckpointError(f"{where}: its config.json does not describe its own weights "
                                f"({' '.join(str(error).split())}); the "
                                f"checkpoint is inconsistent: fix its config.json (or fetch it again)") from None


def _effective(model, name: str):
    """A model field as the model uses it: head_dim unset is d_model / num_heads (a config.json that writes
    that default out is the same model)."""
    value = getattr(model, name)
    if name == "head_dim" and value is None and getattr(model, "num_heads", 0):
        return model.d_model // model.num_heads
    return value


def _set_flags(name: str, value) -> list[str]:
    """The --set flags that give field `name` this value: a group of fields (rope scaling) one flag a field."""
    if dataclasses.is_dataclass(value):
        return [flag for field in dataclasses.fields(value)
                for flag in _set_flags(f"{name}.{field.name}", getattr(value, field.name))]
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, (tuple, list)):
        text = ",".join(str(v) for v in value)
    else:
        text = str(value)
    return [f"--set {name}={text}"]


def check_source_run_family(recipe: Recipe, init_from: str) -> None:
    """ValueError in one line when the spillway run `init_from` names trained another family's model (its
    saved recipe says which): otherwise every weight would differ in shape, one message line each; or trained
    LoRA adapters, whose steps hold the adapters alone (the merged model is what its export writes)."""
    try:
        saved = json.loads(read_recipe_json(init_from))
    except (CheckpointError, json.JSONDecodeError):
        return   # a missing or unreadable checkpoint is reported by the restore, with its own words
    family = saved.get("family") if isinstance(saved, dict) else None
    if isinstance(family, str) and family != recipe.family:
        raise ValueError(f"checkpoint.init_from={init_from}: that run trained a {family} model (recipe "
                         f"{saved.get('name')!r}), but recipe {recipe.name!r} builds a {recipe.family} model; "
                         f"fine-tune it with a {family} recipe, or start from a {recipe.family} run")
    block = saved.get("block") if isinstance(saved, dict) else None
    if isinstance(block, str) and recipe.block is None:
        # else the weights went into the family's own block without a word, and the export of the fine-tune
        # (the family's block) shipped them as the family's model, computing another network
        raise ValueError(f"checkpoint.init_from={init_from}: that run trained the block {block}, and this recipe "
                         f"builds {recipe.family}'s own: set block={block} to fine-tune it (or a block of your "
                         f"choice, set on purpose)")
    lora = saved.get("lora") if isinstance(saved, dict) else None
    if isinstance(lora, dict) and isinstance(lora.get("rank"), int) and lora["rank"] > 0:
        raise ValueError(f"checkpoint.init_from={init_from}: that run trained LoRA adapters, and its steps hold "
                         f"the adapters alone (its base is {(saved.get('checkpoint') or {}).get('init_from')}): "
                         f"export it merged (spillway export {init_from} DIR) and fine-tune from "
                         f"checkpoint.init_from=hf:DIR")
    # Another shape (or another function of the same weights): the restore named every misshapen array after the
    # data was prepared, and nothing of which setting to change. As for an hf: checkpoint, every field is named.
    if not isinstance(saved, dict):
        return
    try:
        source_model = Recipe.from_dict(saved).model
    except (ValueError, TypeError):
        return   # a recipe this version cannot read: the restore says what does not match
    differing = _differing_model_fields(recipe, source_model)
    if differing:
        what, flags = _model_differences(recipe, source_model, differing, "that run")
        raise ValueError(f"checkpoint.init_from={init_from}: recipe {recipe.name!r} differs from the model that run "
                         f"trained in {what}; a fine-tune starts from its weights as they are: match it with "
                         f"{flags}, or train without checkpoint.init_from")


def check_hf_tensors(recipe: Recipe) -> None:
    """HFCheckpointError naming every missing, unexpected or misshapen tensor of an `hf:` init_from, read from
    the safetensors headers alone (names and shapes, no data) against the recipe's model built abstractly.
    Nothing for any other init_from. Call after `resolve_init_from`, before the data is prepared."""
    from spillway.models.hf import HFCheckpointError, check_checkpoint_tensors
    from spillway.recipes.train.step import abstract_model

    directory = hf_checkpoint_dir(recipe.checkpoint.init_from)
    if directory is None or not directory.exists():   # none, or gone from a run resuming its own step (above)
        return

    _, abstract_state = abstract_model(recipe)
    if recipe.lora.enabled:   # the checkpoint is the base: a LoRA run's adapters are not in it
        from spillway.recipes.train.lora_step import split
        abstract_state = split(abstract_state)[1]
    try:
        check_checkpoint_tensors(directory, get_family(recipe.family), recipe.model, abstract_state)
    except HFCheckpointError as error:
        raise HFCheckpointError(f"checkpoint.init_from=hf:{directory}: {error}") from None


def resolve_init_from(recipe: Recipe, say=print) -> Recipe:
    """The recipe checked against its `hf:` checkpoint and given that checkpoint's tokenizer when it names none,
    or names a local copy of a published tokenizer (data.tokenizer_origin) that is not there: a GPU recipe's
    tokenizers/<repository> not fetched, whose tokenizer the checkpoint's is. A tokenizer the user named
    (no origin) is kept, even one that is missing: that is reported as missing.

    Unchanged for a spillway init_from (or none). Call before data or model are built: a wrong model
    fails in a second, not after tokenizing the corpus.
    """
    init_from = recipe.checkpoint.init_from
    directory = hf_checkpoint_dir(init_from)
    if directory is None:
        if init_from and is_hf_checkpoint_folder(Path(init_from).expanduser()):
            raise ValueError(f"checkpoint.init_from={init_from!r} is a Hugging Face checkpoint (config.json and "
                             f"*.safetensors), not a spillway run: write checkpoint.init_from=hf:{init_from}")
        if init_from:
            check_source_run_family(recipe, init_from)
        return recipe
    if _is_spillway_run(directory):   # read as a Hugging Face folder, it was "no config.json ... copy it there"
        raise ValueError(f"checkpoint.init_from={init_from!r} names a spillway run, not a Hugging Face checkpoint "
                         f"(hf: is for a folder of config.json and *.safetensors): write "
                         f"checkpoint.init_from={init_from[len(HF_PREFIX):].strip()}")
    if not directory.exists() and resumes_from_own_step(recipe) and tokenizer_file_in(recipe.run_dir):
        say(f"note: checkpoint.init_from=hf:{directory} is not there; this run resumes from a step of its own, "
            f"which holds the whole model, with the tokenizer copy in its run folder")
        return _named_checkpoint_tokenizer(recipe, directory)
    checkpoint_len = check_model_matches(recipe, directory).max_seq_len
    if recipe.model.max_seq_len > checkpoint_len:
        say(f"note: model.max_seq_len {recipe.model.max_seq_len} is longer than the checkpoint's "
            f"{checkpoint_len} (max_position_embeddings): positions beyond it were never trained")
    named = recipe.data.tokenizer
    if named is not None and Path(named).expanduser().exists():
        _warn_if_not_the_checkpoints_tokenizer(named, directory, say)
    if _takes_checkpoint_tokenizer(recipe):
        found = tokenizer_file_in(directory)
        if found is None:
            if named is not None:
                return recipe   # the missing tokenizer is reported with the run's other missing inputs
            raise ValueError(f"checkpoint.init_from=hf:{directory} holds no tokenizer.json or tokenizer.model, "
                             f"and the recipe names none: a tokenizer trained on the corpus would not match the "
                             f"checkpoint's embedding; set data.tokenizer=PATH")
        instead = "" if named is None else f", instead of data.tokenizer {named!r}, which does not exist"
        say(f"tokenizer: {found} (the checkpoint's{instead})")
    return _named_checkpoint_tokenizer(recipe, directory)


def _is_spillway_run(directory: Path) -> bool:
    """Whether `directory` is a spillway run, its checkpoints folder or a step folder, and no Hugging Face one."""
    if not directory.is_dir() or is_hf_checkpoint_folder(directory):
        return False
    try:
        resolve_step_dir(directory)
    except CheckpointError:
        return False
    return True


def _warn_if_not_the_checkpoints_tokenizer(named: str, directory: Path, say) -> None:
    """A warning line when data.tokenizer maps ids to other tokens than the checkpoint's own tokenizer does: the
    weights learned the checkpoint's ids, and a tokenizer of the same size trained quietly on the wrong ones."""
    from spillway.data import load_tokenizer

    own = tokenizer_file_in(directory)
    if own is None:
        return
    try:
        ours, theirs = load_tokenizer(Path(named).expanduser()), load_tokenizer(directory)
    except (OSError, ValueError):
        return   # an unreadable one is named where the run reads it (data.tokenizer), or is not read at all
    if ours.fingerprint == theirs.fingerprint:
        return
    shared = min(ours.vocab_size, theirs.vocab_size)
    differing = next((i for i in range(shared) if ours.token_text(i) != theirs.token_text(i)), None)
    if differing is None and ours.vocab_size == theirs.vocab_size:
        return   # the same tokens (another BOS/EOS setting is the tokenizer's own business)
    what = (f"token {differing} is {theirs.token_text(differing)!r} there, {ours.token_text(differing)!r} here"
            if differing is not None else f"{theirs.vocab_size} ids there, {ours.vocab_size} here")
    say(f"warning: data.tokenizer {named!r} is not the checkpoint's own tokenizer ({own}): "
        f"{what}; the weights learned the checkpoint's ids (leave data.tokenizer unset to use its own)")


def _takes_checkpoint_tokenizer(recipe: Recipe) -> bool:
    """Whether the run tokenizes with its `hf:` checkpoint's tokenizer: it names none, or names a published
    tokenizer's local copy (data.tokenizer_origin) that is not there."""
    named = recipe.data.tokenizer
    return named is None or bool(recipe.data.tokenizer_origin and not Path(named).expanduser().exists())


def _named_checkpoint_tokenizer(recipe: Recipe, directory: Path) -> Recipe:
    """The recipe naming the checkpoint's folder as its tokenizer where it takes that one
    (`_takes_checkpoint_tokenizer`): what a run's saved recipe then holds, and a resume must match."""
    if _takes_checkpoint_tokenizer(recipe):
        recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(directory)))
    return recipe


def load_init_weights(recipe: Recipe, abstract_params, say=print, *, resuming: bool = False):
    """The parameters `checkpoint.init_from` names, placed in the shardings `abstract_params` carry.
    `resuming`: a LoRA run's base read for a resume (its adapters, optimizer state and schedule come from its
    step), which its line says instead of a fresh start.

    abstract_params: the run's parameter state as ShapeDtypeStructs with shardings
    (recipes/train/step.py abstract_with_shardings), and the form the result comes in: split weights
    (offload.params=host:N, ResidentSplits) are read straight into their parts from a spillway step, and
    loaded whole from a Hugging Face checkpoint, then cut.
    """
    from spillway.recipes.optim import param_placement as placement
    init_from = recipe.checkpoint.init_from
    directory = hf_checkpoint_dir(init_from)
    if directory is None:
        params, meta = restore_params_only(init_from, abstract_params)
        say(_fine_tuning_line(f"{init_from} (weights of step {meta.get('step')})", resuming))
        return params
    from spillway.models.hf import HFCheckpointError

    whole = placement.saved_structs(abstract_params)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, whole)
    try:
        loaded = load_hf_weights(directory, get_family(recipe.family), recipe.model, whole, shardings)
    except HFCheckpointError as error:   # what its tensors' values say (a head said tied that is not): named
        raise HFCheckpointError(f"checkpoint.init_from=hf:{directory}: {error}") from None
    params = placement.params_from_saved(loaded, abstract_params)
    say(_fine_tuning_line(f"the Hugging Face checkpoint {directory}", resuming))
    return params


def _fine_tuning_line(source: str, resuming: bool) -> str:
    if resuming:
        return f"LoRA base: {source}, read at every start (steps hold the adapters, which resume)"
    return f"fine-tuning from {source}; fresh optimizer state and schedule"
