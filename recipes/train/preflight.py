"""What a run needs from outside the project, checked before anything is built: its corpus and its tokenizer.

The GPU recipes name a Hub corpus and the model's own tokenizer by path
(recipes/registry.py). On a machine without a network, or before the
tokenizer was fetched, `check_run_inputs` stops the run at once, before the
run directory is taken, any compile or any data preparation, with one line
(a `MissingInputError`: the `spillway` command prints it and exits 2) that
names every missing input and the exact `--set` that points the run at a
local copy. Checked:

* `data.tokenizer`, when set: the file, or a folder holding tokenizer.json or
  tokenizer.model. With `data.tokenizer_origin` (the Hub repository it is a
  copy of) the line also says how to fetch it.
* `data.source`, or each source of `data.mixture`: a local path must exist
  and hold corpus files; a Hub dataset must be reachable
  (data/hub_reach.py: one metadata request, none when HF_HUB_OFFLINE is set).
* `checkpoint.init_from=hf:DIR`: the folder must exist (what it holds is checked later,
  recipes/train/init_weights.py). With `checkpoint.init_from_origin` the line says how to fetch it;
  a published tokenizer's local copy missing beside it is not named (the checkpoint brings it).
* `checkpoint.init_from=DIR` (a spillway run or step folder): it must exist, unless the run resumes from a
  step of its own (not a LoRA run, which reads its base at every start).

A run that resumes from a step of its own reads neither its source's weights nor its named tokenizer: it
tokenizes with the copy in its run folder (the tokenizer it trained with), so a fine-tune's `hf:` base folder
or a `data.tokenizer` removed since it started is not missing for it (recipes/train/resume.py
`resumes_from_own_step`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from spillway.data.hub_reach import LOCAL_CORPUS, hub_unreachable_reason, local_copy_advice
from spillway.data.mixture import parse_mixture
from spillway.data.sources import MissingSplitError, parse_hub_spec, parse_local_spec
from spillway.data.tokenizer import TOKENIZER_FILES, tokenizer_file_in
from spillway.layers.errors import DataError
from spillway.recipes.config import DataConfig, Recipe

LOCAL_TOKENIZER = "a tokenizer.json, a sentencepiece .model, or a folder holding either"


class MissingInputError(DataError):
    """The run's corpus or tokenizer is not there; the message names each and how to point at a local copy."""


def check_run_inputs(recipe: Recipe) -> None:
    """MissingInputError naming every input of the recipe that is missing (one line); nothing when all are there.
    First, a data cache folder that cannot be written (a run started in a read-only folder said only
    ".cache: Permission denied")."""
    _check_cache_writable(recipe.data)
    base = _base_model_problem(recipe)
    data = recipe.data
    if data.tokenizer_origin and _checkpoint_brings_a_tokenizer(recipe):
        # A published tokenizer's local copy that is not there is not missing on its own: the hf: checkpoint
        # brings that tokenizer (init_weights.resolve_init_from), so only a missing checkpoint is named.
        data = dataclasses.replace(data, tokenizer=None)
    from spillway.recipes.train.resume import resumes_from_own_step   # here: it imports orbax

    if data.tokenizer is not None and resumes_from_own_step(recipe) and tokenizer_file_in(recipe.run_dir):
        data = dataclasses.replace(data, tokenizer=None)   # it tokenizes with its own copy, named or not
    problems = missing_inputs(data) + [problem for problem in [base] if problem]
    if not problems:
        return
    if len(problems) == 1:
        raise MissingInputError(f"recipe {recipe.name}: {problems[0]}")
    numbered = "; ".join(f"({number}) {problem}" for number, problem in enumerate(problems, start=1))
    raise MissingInputError(f"recipe {recipe.name}: {len(problems)} inputs are missing: {numbered}")


def _check_cache_writable(data: DataConfig) -> None:
    folder = data.cache_path
    fix = "point it at a folder you can write with --set data.cache_dir=DIR"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"data.cache_dir {str(data.cache_dir)!r} ({folder.absolute()}) cannot be made "
                        f"({error.strerror or error}): {fix}") from None
    if not os.access(folder, os.W_OK):
        raise DataError(f"data.cache_dir {str(data.cache_dir)!r} ({folder.absolute()}) is not writable: {fix}")


def check_base_model_first(recipe: Recipe) -> None:
    """`check_run_inputs` now when an `hf:` checkpoint.init_from is missing: reading the base comes before the
    other inputs are checked (it may bring the tokenizer), so without it the line names everything missing."""
    if _base_model_problem(recipe):
        check_run_inputs(recipe)


def missing_inputs(data: DataConfig) -> list[str]:
    """One phrase per missing input: what is missing, and the --set that points at a local copy."""
    problems = []
    if data.tokenizer is not None:
        problems.append(_tokenizer_problem(data.tokenizer, data.tokenizer_origin))
    if data.mixture:
        components = parse_mixture(data.mixture)
        for component in components:
            fix = "--set data.mixture=" + ",".join(
                f"{c.name}={c.weight:g}:{'DIR' if c is component else c.source}" for c in components)
            problems.append(_source_problem(f"data.mixture source {component.name!r}", component.source, fix,
                                            data.split))
    else:
        problems.append(_source_problem("data.source", data.source, "--set data.source=DIR", data.split))
    return [problem for problem in problems if problem is not None]


def _tokenizer_problem(path_text: str, origin: str | None) -> str | None:
    path = Path(path_text).expanduser()
    if path.is_file() or (path.is_dir() and tokenizer_file_in(path) is not None):
        return None
    if path.is_dir():
        slow = [name for name in ("vocab.json", "merges.txt", "vocab.txt") if (path / name).is_file()]
        # a "slow" transformers tokenizer's files: transformers converts them, spillway reads the fast file only
        read_by = (f" ({' and '.join(slow)} are a slow tokenizer's files, which spillway does not read: save the "
                   f"fast one with transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
                   if slow else "")
        what = f"data.tokenizer {path_text!r} holds neither {' nor '.join(TOKENIZER_FILES)}{read_by}"
    else:
        what = f"data.tokenizer {path_text!r} does not exist"
    fetch = ""
    if origin:
        folder = path.parent if path.suffix in (".json", ".model") else path
        fetch = (f" (it is {origin}'s tokenizer: fetch it with `hf download {origin} --include '*.json' "
                 f"tokenizer.model --local-dir {folder}`)")
    if not origin:
        return f"{what}: point it at {LOCAL_TOKENIZER} (--set data.tokenizer=PATH)"
    return f"{what}{fetch}; or point at a local copy with --set data.tokenizer=PATH ({LOCAL_TOKENIZER})"


def _base_model_problem(recipe: Recipe) -> str | None:
    """The phrase for an `hf:` checkpoint.init_from whose folder does not exist; None otherwise (a folder that is
    there but wrong is init_weights.py's to name, file by file)."""
    from spillway.recipes.train.init_weights import hf_checkpoint_dir   # here: it imports jax and the models
    from spillway.recipes.train.checkpoint_dirs import steps_beside
    from spillway.recipes.train.resume import resumes_from_own_step

    init_from, origin = recipe.checkpoint.init_from, recipe.checkpoint.init_from_origin
    folder = hf_checkpoint_dir(init_from)
    if folder is None:
        # A spillway run or step folder (a fine-tune of one's own pretraining run): it must be there too.
        if not init_from or Path(init_from).expanduser().exists() or resumes_from_own_step(recipe):
            return None
        if steps := steps_beside(init_from):   # a step the source run's retention removed, or a typo
            return f"checkpoint.init_from {init_from!r} does not exist{steps}"
        return (f"checkpoint.init_from {init_from!r} does not exist: train that run first{_run_of(init_from)}, or "
                f"point at a run directory or step folder with --set checkpoint.init_from=DIR")
    if folder.exists():
        return None
    if resumes_from_own_step(recipe):
        if tokenizer_file_in(recipe.run_dir) is not None:
            return None   # its weights and its tokenizer come from its run folder
        # A run folder without its tokenizer copy (removed by hand): the base's is the one it trained with.
        return (f"checkpoint.init_from {init_from!r} does not exist: this run resumes from a step of its own, but "
                f"its run folder {recipe.run_dir} has lost its copy of that checkpoint's tokenizer; put the folder "
                f"back where it was (or train into another checkpoint.dir to start over)")
    fetch = (f" (it is {origin}: fetch it with `hf download {origin} --exclude 'original/*' --local-dir {folder}`)"
             if origin else "")
    # without a Hub repository to fetch from, "; or point at ..." offered an alternative to nothing
    return (f"checkpoint.init_from {init_from!r} does not exist{fetch}{'; or point' if origin else ': point'} at a "
            f"local copy with --set checkpoint.init_from=hf:DIR (a Hugging Face model folder: config.json and "
            f"*.safetensors)")


def _checkpoint_brings_a_tokenizer(recipe: Recipe) -> bool:
    """Whether an `hf:` checkpoint.init_from will bring the tokenizer: one not yet fetched (named missing on its
    own), or one that holds a tokenizer file. Checked on the recipe as given (`spillway train --plan` checks
    before resolve_init_from has put the checkpoint's tokenizer in)."""
    from spillway.recipes.train.init_weights import hf_checkpoint_dir   # here: it imports jax and the models

    folder = hf_checkpoint_dir(recipe.checkpoint.init_from)
    return folder is not None and (not folder.exists() or tokenizer_file_in(folder) is not None)


def _run_of(init_from: str) -> str:
    """How the run a fine-tune starts from is made, where its folder is a recipe's own (runs/<recipe>)."""
    from spillway.recipes.registry import recipe_names

    name = Path(init_from).name
    # only where the recipe's own run lands from here (`gone/runs/tiny` is not what `spillway train tiny` writes)
    if name in recipe_names() and Path(init_from).expanduser().absolute() == Path.cwd() / "runs" / name:
        made = ", what `make train` does" if name == "tiny" else ""
        return f" (`spillway train {name}` writes runs/{name}{made})"
    return ""


def _source_problem(field: str, source: str, fix: str, split: str) -> str | None:
    try:
        hub = parse_hub_spec(source)
        if hub is None:
            parse_local_spec(source, split)   # raises for a path that does not exist or holds no corpus files
            return None
    except MissingSplitError:
        raise   # the source is there: its line names the splits it has, not a local copy to point at
    except (OSError, ValueError) as error:
        said = f"{field} {source!r}: {' '.join(str(error).split())}"
        if Path(source).expanduser().exists():   # there, but not readable as a corpus: its error says what to do
            return said
        return f"{said}; point it at a local copy with {fix} ({LOCAL_CORPUS})"
    reason = hub_unreachable_reason(hub)
    if reason is None:
        return None
    config = f" (config {hub.config})" if hub.config else ""
    return (f"{field} {source!r} is the Hugging Face Hub dataset {hub.repo_id}{config}, streamed while training, "
            f"and {reason}: {local_copy_advice(hub, fix)}")
