"""Whether a run put a BOS before each document, as recorded in its `RUN_DIR/tokenizer_config.json`.

A resumed run (or a fine-tune of it) must tokenize as the run started: a BOS
added or dropped would give other rows, and the saved data position would
point elsewhere. Every run writes `add_bos_token` into the tokenizer_config.json
of its run directory (data/tokenizer.py `save_to_directory`). A run directory
whose tokenizer_config.json has no `add_bos_token` was written by spillway
before BOS were added at all: it tokenized without one. A run directory without
a tokenizer_config.json records nothing (the run never got to save one).

The data cache keys on the tokenizer's fingerprint, which includes the BOS
only when one is added (data/hf_tokenizer.py, data/spm_tokenizer.py): a run
that keeps tokenizing without a BOS reuses the cache it always had.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spillway.data import Tokenizer
from spillway.data.tokenizer import TOKENIZER_CONFIG_FILE
from spillway.recipes.train.errors import RunError


def recorded_bos(run_dir: str | os.PathLike) -> bool | None:
    """Whether the run in `run_dir` put a BOS before each document; None where it recorded nothing."""
    path = Path(run_dir) / TOKENIZER_CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(saved, dict):
        return None
    return bool(saved.get("add_bos_token", False))   # absent: from before spillway added BOS, so none


class TokenizerChangedError(RunError):
    """The tokenizer a resumed run names is no longer the one it trained with."""


def kept_tokenizer_file(run_dir: str | os.PathLike, named: str | None) -> Path | None:
    """The tokenizer file a resumed run tokenizes with: its own copy in RUN_DIR (None: it saved none, and the
    named tokenizer is read). The tokenizer it names, where there, must still give the same ids: one edited or
    retrained in place since the run started (same path, other ids) raises TokenizerChangedError; before, the
    resume read the new one without a word and overwrote the run's copy with it. BOS are compared apart
    (`recorded_bos`): here the vocabulary, the rules and the EOS."""
    from spillway.data import load_tokenizer, tokenizer_file_in

    own = tokenizer_file_in(run_dir)
    if own is None or not named or not Path(named).expanduser().exists():
        return own
    try:
        changed = (load_tokenizer(named).with_bos(False).fingerprint !=
                   load_tokenizer(own).with_bos(False).fingerprint)
        why = "gives other ids than"
    except (OSError, ValueError) as error:
        changed, why = True, f"cannot be read ({' '.join(str(error).split())}), unlike"
    if changed:
        raise TokenizerChangedError(
            f"{run_dir}: cannot resume: data.tokenizer {named!r} {why} the copy this run trained with ({own}): it "
            f"was edited or retrained since the run started. Restore it to go on (the run's copy is the tokenizer "
            f"it trained with: copy it back, with its {TOKENIZER_CONFIG_FILE}); to train on with the new tokenizer, "
            f"fine-tune into another checkpoint.dir (checkpoint.init_from)")
    return own


def require_tokenizer_copy(run_dir: str | os.PathLike) -> None:
    """RunError where the run folder's tokenizer copy was removed, saying which tokenizer to copy back. It was "not
    inside a spillway run directory" or "holds no tokenizer", which sent users looking for another folder. Called
    before anything slow or written (generate reads weights after it, export writes files)."""
    from spillway.data import tokenizer_file_in
    from spillway.data.tokenizer import TOKENIZER_FILES

    if tokenizer_file_in(run_dir) is not None:
        return
    raise RunError(f"{run_dir} is a spillway run whose copy of its tokenizer is gone (neither "
                   f"{' nor '.join(TOKENIZER_FILES)} there, written when it started): {_how_to_restore(run_dir)}")


def _how_to_restore(run_dir: str | os.PathLike) -> str:
    """Where the lost copy came from: the tokenizer the recipe names (unless that is the lost copy itself, as a
    fine-tune's is), else the one of the checkpoint it started from; a tokenizer it trained is trained again."""
    from spillway.data import tokenizer_file_in
    from spillway.recipes.train.checkpoint import CheckpointError, read_recipe_json, resolve_step_dir, run_dir_of
    from spillway.recipes.train.init_weights import hf_checkpoint_dir

    generic = f"copy the tokenizer it trained with back into it, with its {TOKENIZER_CONFIG_FILE} if that is gone too"
    try:
        recipe = json.loads(read_recipe_json(run_dir))
        named, init_from = recipe["data"]["tokenizer"], recipe["checkpoint"]["init_from"]
        sources = [Path(named).expanduser()] if named else []
        if init_from and (folder := hf_checkpoint_dir(init_from)) is not None:
            sources.append(folder)
        elif init_from:
            sources.append(Path(run_dir_of(resolve_step_dir(init_from)) or init_from))
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return generic   # no step, no recipe to read, or its source gone: the advice without a name
    own = Path(run_dir).expanduser().absolute()
    for source in sources:
        found = tokenizer_file_in(source) if source.is_dir() else source if source.is_file() else None
        if found is not None and own not in found.absolute().parents:
            return f"copy {found} back into it (the tokenizer it started with), with its {TOKENIZER_CONFIG_FILE}"
    if not named and not init_from:   # trained on its corpus: the same corpus and settings train the same one
        return (f"it trained its tokenizer on its corpus, and trains it again, the same, when it resumes "
                f"(`spillway train` its recipe with --set checkpoint.dir={run_dir})")
    return generic


def run_tokenizer(run_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer a run trained with: its file in RUN_DIR, with or without a BOS as its documents started
    (a run from before BOS were recorded: as the files say)."""
    from spillway.data import load_tokenizer

    require_tokenizer_copy(run_dir)
    tokenizer = load_tokenizer(run_dir)
    kept = recorded_bos(run_dir)
    return tokenizer if kept is None else tokenizer.with_bos(kept)


def new_run_adds_bos(tokenizer: Tokenizer, add_bos: bool | None) -> bool:
    """Whether a run starting now with this tokenizer and `data.add_bos` would put a BOS first."""
    return tokenizer.with_bos(None).adds_bos if add_bos is None else add_bos


def describe_kept_bos(tokenizer: Tokenizer, kept: bool, add_bos: bool | None) -> str | None:
    """The line a resumed run says when it keeps a BOS choice other than a new run's (None: they agree)."""
    if new_run_adds_bos(tokenizer, add_bos) == kept:
        return None
    bos = tokenizer.bos_id
    token = f"{tokenizer.token_text(bos)!r} (id {bos})" if bos is not None else "a BOS"
    if kept:
        return (f"tokenizer: this run started with {token} before each document and keeps it (its data must not "
                f"change under it); a new run with this recipe would add none")
    return (f"tokenizer: this run started without a BOS before each document and keeps it that way (its data "
            f"must not change under it); a new run with this tokenizer puts {token} first, as its family's "
            f"tokenizer does")
