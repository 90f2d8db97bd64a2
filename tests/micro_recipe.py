"""The micro recipe that the end-to-end tests train: `tiny` at two layers of width 32, 32-token rows, batch 8.

Seconds per run on one CPU core, and the same shapes, so the same compiled
programs, in every test that uses it: within one run of the suite the second
and later trains of it read their step from JAX's compilation cache
(tests/conftest.py). The data cache is shared too (the `micro_data_cache`
fixture, tests/conftest.py): the embedded corpus is tokenized once per run.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = "builtin:stdlib:400000"
# Every setting but the data source, the data cache and the run folder.
MICRO = ["data.seq_len=32", "data.num_proc=1",
         "model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=64",
         "train.global_batch=8", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
         "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2"]


def micro_overrides(cache_dir: Path, run_dir: Path, *extra: str, source: str = SOURCE) -> list[str]:
    """The micro recipe's --set overrides, then `extra` (a later setting of a field wins)."""
    return [*MICRO, f"data.source={source}", f"data.cache_dir={cache_dir}", f"checkpoint.dir={run_dir}", *extra]


def micro(cache_dir: Path, run_dir: Path, *extra: str, source: str = SOURCE):
    """The micro recipe as a Recipe."""
    from spillway.recipes.registry import get_recipe

    return get_recipe("tiny", micro_overrides(cache_dir, run_dir, *extra, source=source))
