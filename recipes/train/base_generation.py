"""What a fine-tune of an `hf:` checkpoint keeps of the base's generation_config.json: its sampling settings and
its stop ids.

Llama 3.1 Instruct stops at three tokens (<|end_of_text|>, <|eom_id|>, <|eot_id|>), which its tokenizer names
as EOS only one of. The export writes them beside the run's own stop ids (recipes/export.py), and `spillway
generate` and a run's closing sample stop at them too, so the run and its export generate the same tokens.
The base's ids are its tokenizer's: they are kept only where the run tokenizes with the base's own tokenizer
file, and an id past that tokenizer's vocabulary (a config written with a family's default ids) is left out.
The base folder is read where the recipe's `checkpoint.init_from` names it when the run starts, and what it
says is kept in `RUN_DIR/base_generation.json` (`keep_base_generation`): a base moved or removed since, a
relative `hf:` path read from another directory, and a fine-tune of this run (with its tokenizer) still find
it. A run started before that file read the base folder each time, as it still does where the file is absent.
The base's config.json is kept the same way (`RUN_DIR/base_config.json`, `keep_base_config`): an adapter export
reads in it whether a Gemma 3 base is multimodal, and `export --adapter` needs no base folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway.recipes.config import Recipe

GENERATION_CONFIG = "generation_config.json"
BASE_GENERATION_FILE = "base_generation.json"   # in RUN_DIR: what the base's file said when the run started
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
BASE_CONFIG_FILE = "base_config.json"   # in RUN_DIR: the hf: base's config.json when the run started


def hf_base_json(recipe: Recipe, name: str) -> tuple[Path, dict] | None:
    """(the run's hf: base folder, its JSON file `name`), or None where the run has no hf: base or the file is
    not there or not a JSON object (the base may have been removed since the run trained)."""
    from spillway.recipes.train.init_weights import hf_checkpoint_dir

    try:
        folder = hf_checkpoint_dir(recipe.checkpoint.init_from)
        value = None if folder is None else json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return (folder, value) if isinstance(value, dict) else None


def base_generation_config(recipe: Recipe, run_dir: Path, vocab_size: int) -> tuple[dict, list[int], list[int]]:
    """(the base's generation_config.json without its token ids, its stop ids the run keeps, its stop ids left
    out as past the vocabulary of `vocab_size` ids); ({}, [], []) where there is no such base file."""
    kept = _kept(Path(run_dir))
    if kept is not None:
        return kept["settings"], kept["stops"], kept["dropped"]
    return _read_base(recipe, run_dir, vocab_size)


def keep_base_generation(recipe: Recipe, run_dir: Path, vocab_size: int) -> None:
    """RUN_DIR/base_generation.json, once, when the run starts (module docstring): from its hf: base folder, or
    from the spillway run it fine-tunes where it tokenizes with that run's tokenizer. Nothing where neither
    says anything."""
    run_dir = Path(run_dir)
    if _kept(run_dir) is not None:
        return
    settings, stops, dropped = _read_base(recipe, run_dir, vocab_size)
    if not (settings or stops or dropped):
        settings, stops, dropped = _from_source_run(recipe, run_dir)
    if settings or stops or dropped:
        _keep(run_dir, BASE_GENERATION_FILE, {"settings": settings, "stops": stops, "dropped": dropped})


def keep_base_config(recipe: Recipe, run_dir: Path) -> None:
    """RUN_DIR/base_config.json, once, when the run starts: the hf: base's config.json (module docstring)."""
    if (Path(run_dir) / BASE_CONFIG_FILE).is_file():   # kept when the run started: a resume reads no base
        return
    found = hf_base_json(recipe, "config.json")
    if found is not None:
        _keep(Path(run_dir), BASE_CONFIG_FILE, found[1])


def kept_base_config(run_dir: Path) -> dict | None:
    """The base's config.json as `keep_base_config` kept it; None where the run kept none (started before)."""
    return _read_kept(Path(run_dir), BASE_CONFIG_FILE)


def _keep(run_dir: Path, name: str, document: dict) -> None:
    from spillway.data.cache import atomic_write_bytes

    atomic_write_bytes(run_dir / name, (json.dumps(document, indent=2) + "\n").encode())


def _read_kept(run_dir: Path, name: str) -> dict | None:
    """A JSON object the run kept (`_keep`); None where it kept none or it cannot be read."""
    try:
        kept = json.loads((run_dir / name).read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


def _kept(run_dir: Path) -> dict | None:
    kept = _read_kept(run_dir, BASE_GENERATION_FILE)
    if not (kept is not None and isinstance(kept.get("settings"), dict)
            and all(isinstance(kept.get(key), list) for key in ("stops", "dropped"))):
        return None
    return kept


def _from_source_run(recipe: Recipe, run_dir: Path) -> tuple[dict, list[int], list[int]]:
    """What the spillway run `checkpoint.init_from` is in kept of its base, where this run tokenizes with that
    run's tokenizer file (a fine-tune's own copy of it)."""
    from spillway.recipes.train.checkpoint import resolve_step_dir, run_dir_of
    from spillway.recipes.train.errors import RunError

    init_from = recipe.checkpoint.init_from
    if not init_from or init_from.startswith("hf:"):
        return {}, [], []
    try:
        source = run_dir_of(resolve_step_dir(init_from))
    except (OSError, ValueError, RunError):   # the source run removed since: a resume needs nothing of it
        return {}, [], []
    kept = _kept(Path(source)) if source is not None else None
    if kept is None or not _same_tokenizer_file(Path(source), run_dir):
        return {}, [], []
    return kept["settings"], kept["stops"], kept["dropped"]


def _same_tokenizer_file(folder: Path, run_dir: Path) -> bool:
    return any((folder / name).is_file() and (run_dir / name).is_file()
               and (folder / name).read_bytes() == (run_dir / name).read_bytes()
               for name in ("tokenizer.json", "tokenizer.model"))


def _read_base(recipe: Recipe, run_dir: Path, vocab_size: int) -> tuple[dict, list[int], list[int]]:
    found = hf_base_json(recipe, GENERATION_CONFIG)
    if found is None:
        return {}, [], []
    folder, base = found
    same_tokenizer = _same_tokenizer_file(folder, Path(run_dir))
    eos = base.get("eos_token_id")
    stops = [i for i in (eos if isinstance(eos, list) else [eos])
             if isinstance(i, int) and not isinstance(i, bool)] if same_tokenizer else []
    settings = {key: value for key, value in base.items() if key not in TOKEN_ID_FIELDS}
    return settings, [i for i in stops if 0 <= i < vocab_size], [i for i in stops if not 0 <= i < vocab_size]


def base_stop_ids(recipe: Recipe, run_dir: Path, tokenizer) -> tuple[int, ...]:
    """The base's stop ids a run's generation stops at beside its tokenizer's EOS (module docstring)."""
    return tuple(base_generation_config(recipe, run_dir, tokenizer.vocab_size)[1])
