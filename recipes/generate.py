"""`spillway generate`: rebuild a run's model from its checkpoint and recipe, then sample.

The checkpoint may be named by its run directory, the run's `checkpoints/`
directory (both: the newest step) or one step folder; the tokenizer is the
run's `tokenizer.model`.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from spillway.data import load_tokenizer, tokenizer_file_in
from spillway.layers.sharding import make_mesh, state_shardings
from spillway.recipes.config import Recipe
from spillway.recipes.sampling import generate


def generate_from_checkpoint(path: str, prompt: str, *, max_new_tokens: int, temperature: float, top_p: float,
                             seed: int = 0) -> str:
    import json

    from spillway.recipes.train.checkpoint import read_recipe_json, resolve_step_dir, restore_params_only, run_dir_of
    from spillway.recipes.train.step import abstract_model, abstract_with_shardings

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    ckpt = resolve_step_dir(path)  # one step: the recipe, weights and tokenizer all come from the same run
    run_dir = run_dir_of(ckpt)
    if run_dir is None or tokenizer_file_in(run_dir) is None:
        raise FileNotFoundError(f"{path} is not inside a spillway run directory (no tokenizer.json or "
                                f"tokenizer.model beside its checkpoints/ folder)")
    recipe = Recipe.from_dict(json.loads(read_recipe_json(ckpt)))
    mesh = make_mesh(1, -1, 1, devices=jax.devices()[:1])
    # Restore straight into the abstract model's shards: no random initialisation to throw away.
    graphdef, abstract_state = abstract_model(recipe)
    target = abstract_with_shardings(abstract_state, state_shardings(abstract_state, mesh))
    params, _ = restore_params_only(ckpt, target)
    model = nnx.merge(graphdef, params)
    tokenizer = load_tokenizer(run_dir)
    prompt_ids = tokenizer.encode([prompt])[0] or [tokenizer.eos_id]
    room = recipe.model.max_seq_len - len(prompt_ids)
    if room <= 0:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens; the model's max_seq_len is {recipe.model.max_seq_len}")
    new_ids = generate(model, prompt_ids, max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                       top_p=top_p, seed=seed, stop_id=tokenizer.eos_id)
    return tokenizer.decode(prompt_ids + new_ids)
