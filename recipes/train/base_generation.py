"""What a fine-tune of an `hf:` checkpoint keeps of the base's generation_config.json: its sampling settings and
its stop ids.

Llama 3.1 Instruct stops at three tokens (<|end_of_text|>, <|eom_id|>, <|eot_id|>), which its tokenizer names
as EOS only one of. The export writes them beside the run's own stop ids (recipes/export.py), and `spillway
generate` and a run's closing sample stop at them too, so the run and its export generate the same tokens.
The base's ids are its tokenizer's: they are kept only where the run tokenizes with the base's own tokenizer
file, and an id past that tokenizer's vocabulary (a config written with a family's default ids) is left out.
The base folder is read where the recipe's `checkpoint.init_from` names it; one removed since is no base.
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway.recipes.config import Recipe

GENERATION_CONFIG = "generation_config.json"
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
    found = hf_base_json(recipe, GENERATION_CONFIG)
    if found is None:
        return {}, [], []
    folder, base = found
    same_tokenizer = any((folder / name).is_file() and (Path(run_dir) / name).is_file()
                         and (folder / name).read_bytes() == (Path(run_dir) / name).read_bytes()
                         for name in ("tokenizer.json", "tokenizer.model"))
    eos = base.get("eos_token_id")
    stops = [i for i in (eos if isinstance(eos, list) else [eos])
             if isinstance(i, int) and not isinstance(i, bool)] if same_tokenizer else []
    settings = {key: value for key, value in base.items() if key not in TOKEN_ID_FIELDS}
    return settings, [i for i in stops if 0 <= i < vocab_size], [i for i in stops if not 0 <= i < vocab_size]


def base_stop_ids(recipe: Recipe, run_dir: Path, tokenizer) -> tuple[int, ...]:
    """The base's stop ids a run's generation stops at beside its tokenizer's EOS (module docstring)."""
    return tuple(base_generation_config(recipe, run_dir, tokenizer.vocab_size)[1])
