"""`spillway generate`: rebuild a run's model from its checkpoint and recipe, then sample.

The checkpoint may be named by its run directory, the run's `checkpoints/`
directory (both: the newest readable step) or one step folder; the tokenizer
is the run's (`tokenizer.json` or `tokenizer.model`).

Named by its run, a newest step that is corrupt is passed over for the next
older one with a warning, as `train` does (nothing is renamed: generate only
reads), and a step that the live run's retention (`checkpoint.keep`) deleted
while it was being read is read again from the newest step, never reported
as corrupt (recipes/readable_step.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
from flax import nnx

from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh, state_shardings
from spillway.models.hf import is_hf_checkpoint_folder, peft_adapter_base
from spillway.recipes.train.base_generation import base_stop_ids
from spillway.recipes.config import Recipe
from spillway.recipes.readable_step import restore_readable
from spillway.recipes.sampling import generate
from spillway.recipes.train.chat_prompt import chat_prompt, text_prompt

def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def generate_from_checkpoint(path: str, prompt: str | None, *, max_new_tokens: int, temperature: float, top_p: float,
                             seed: int = 0, warn=None, chat: str | None = None) -> str:
    """The prompt and its continuation; with `chat`, the message rendered as the user's turn through the run's
    chat template (the one it trained with, kept in RUN_DIR/tokenizer_config.json), sampled until the
    end-of-turn token, and only the answer returned."""
    from spillway.recipes.train.checkpoint import resolve_step_dir, run_dir_of
    from spillway.recipes.train.checkpoint_dirs import steps_beside, without_hf_prefix
    from spillway.recipes.train.step import abstract_model, abstract_with_shardings
    from spillway.recipes.train.tokenization_record import require_tokenizer_copy, run_tokenizer

    warn = warn or (lambda line: print(line, file=sys.stderr))
    path = Path(without_hf_prefix(path)).expanduser()   # a quoted `~/run` as export and init_from read it
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist{steps_beside(path)}")
    if is_hf_checkpoint_folder(path):   # an export, or a download: "no finalised step folder" said nothing of it
        raise ConfigError(f"{path} is a Hugging Face checkpoint (config.json and *.safetensors), not a spillway "
                          f"run: generate samples a run's steps; load this folder with transformers "
                          f"(AutoModelForCausalLM.from_pretrained), or fine-tune from it with --set "
                          f"checkpoint.init_from=hf:{path}")
    if path.is_dir() and (base := peft_adapter_base(path)):   # `spillway export --adapter`'s folder, say
        raise ConfigError(f"{path} is a PEFT adapter (adapter_config.json) of {base}, not a spillway run: generate "
                          f"samples a run's steps; name the run it was exported from, or load it with peft onto "
                          f"its base")
    ckpt = resolve_step_dir(path)  # one step: the recipe, weights and tokenizer all come from the same run
    run_dir = run_dir_of(ckpt)
    if run_dir is None:
        raise FileNotFoundError(f"{path} is not inside a spillway run directory (a step folder's parent is a "
                                f"run's checkpoints/ folder)")
    require_tokenizer_copy(run_dir)   # before the weights are read
    mesh = make_mesh(MeshConfig(1, -1, 1), devices=jax.devices()[:1])
    built = {}

    def target_of(recipe: Recipe):
        # Restore straight into the abstract model's shards: no random initialisation to throw away.
        graphdef, abstract_state = abstract_model(recipe)
        built["graphdef"] = graphdef
        return abstract_with_shardings(abstract_state, state_shardings(abstract_state, mesh))

    ckpt, recipe, params = restore_readable(path, ckpt, target_of, warn)
    model = nnx.merge(built["graphdef"], params)
    tokenizer = run_tokenizer(run_dir)   # a prompt starts as the run's documents did
    prefix: list[int] = []
    if chat is not None:   # the chat template writes the BOS itself where the tokenizer starts documents with one
        prompt_ids, stop_ids = chat_prompt(run_dir, recipe, tokenizer, chat)
    else:   # a prompt starts as the documents the model trained on did: with the BOS, if they had one
        prefix, prompt_ids, stop_ids = text_prompt(run_dir, tokenizer, prompt)
    room = recipe.model.max_seq_len - len(prompt_ids)
    if room <= 0:
        raise ValueError(f"the prompt is {_tokens(len(prompt_ids))}; the model's max_seq_len is "
                         f"{recipe.model.max_seq_len}, so a prompt may be at most "
                         f"{_tokens(recipe.model.max_seq_len - 1)} (one more is generated)")
    if max_new_tokens > room:
        warn(f"warning: --tokens {max_new_tokens} capped at {room}: the prompt is {_tokens(len(prompt_ids))} and the "
             f"model's max_seq_len is {recipe.model.max_seq_len}")
    stop_ids = (*stop_ids, *base_stop_ids(recipe, run_dir, tokenizer))   # where the run's export stops too
    new_ids = generate(model, prompt_ids, max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                       top_p=top_p, seed=seed, stop_id=tokenizer.eos_id, stop_ids=stop_ids,
                       vocab_limit=tokenizer.vocab_size)
    if chat is not None:
        # blank lines around the answer dropped, its first line's indentation kept (a code answer's)
        return tokenizer.decode(new_ids).lstrip("\r\n").rstrip()
    return tokenizer.decode(prompt_ids[len(prefix):] + new_ids)   # the text, without the BOS put first
