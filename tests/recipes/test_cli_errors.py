"""Errors a new user causes are one line that names the cause, never "internal error, please report it",
and never advice about something else.

Here: a recipe's own block (`--set block=`) that raises on import, has the
wrong constructor or returns the wrong shape, in `train` and in `plan`.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from micro_recipe import MICRO
from spillway.recipes import cli

BLOCKS = {
    "nu_raising_block": 'raise RuntimeError("boom at import")\n',
    "nu_wrong_init_block": textwrap.dedent("""
        from spillway.layers.block import TransformerBlock
        class Block(TransformerBlock):
            def __init__(self, cfg):
                super().__init__(cfg)
    """),
    "nu_exiting_block": "import sys\nsys.exit(0)   # a script's exit reached at import: spillway exited 0\n",
    "nu_wrong_shape_block": textwrap.dedent("""
        from spillway.layers.block import TransformerBlock
        class Block(TransformerBlock):
            def forward(self, x_btd, ctx, cache):
                return x_btd[..., :3], cache
    """),
    "nu_bare_array_block": textwrap.dedent("""
        from spillway.layers.block import TransformerBlock
        class Block(TransformerBlock):
            def forward(self, x_btd, ctx, cache):
                return x_btd + self.mlp(self.mlp_norm(x_btd))
    """),
}
EXPECTED = {
    "nu_raising_block": r"block: importing 'nu_raising_block' failed: RuntimeError: boom at import",
    "nu_exiting_block": r"block: importing 'nu_exiting_block' failed: SystemExit: 0",
    "nu_wrong_init_block": r"block nu_wrong_init_block:Block: building it as Block\(cfg, rngs=rngs\) failed "
                           r"\(.*unexpected keyword argument 'rngs'\); a block's __init__ takes \(cfg, \*, rngs\)",
    "nu_wrong_shape_block": r"block nu_wrong_shape_block:Block: forward\(\) returns an array of shape \(1, 8, 3\) "
                            r"\(float32\) for an input of \(1, 8, 32\)",
    # it returned the stream alone: named as such, not as the stream's first row (a new user's finding)
    "nu_bare_array_block": r"block nu_bare_array_block:Block: forward\(\) returns an array of shape \(1, 8, 32\); a "
                           r"block returns a pair \(the residual stream.*`return x_btd, cache`",
}


@pytest.fixture
def user_blocks(tmp_path, monkeypatch):
    for name, source in BLOCKS.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)   # found in the current directory, as `spillway` run there finds it
    yield tmp_path
    for name in BLOCKS:
        sys.modules.pop(name, None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def sets(*values):
    return [arg for value in values for arg in ("--set", value)]


@pytest.mark.parametrize("module", list(BLOCKS))
def test_a_broken_user_block_is_named_in_train_and_in_plan(module, user_blocks, tmp_path, capsys, monkeypatch):
    from spillway.recipes.plan import scheduler

    def no_compiles(*args, **kwargs):
        raise AssertionError("compile processes started for a block that cannot be built")
    monkeypatch.setattr(scheduler, "run_children", no_compiles)
    block = f"block={module}:Block"
    status = cli.main(["train", "tiny", *sets(*MICRO, "data.source=builtin:stdlib:400000", "train.steps=1",
                                              f"data.cache_dir={tmp_path / 'cache'}",
                                              f"checkpoint.dir={tmp_path / 'run'}", block)])
    err = capsys.readouterr().err
    assert status == cli.EXIT_USER_ERROR, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1
    assert __import__("re").search(EXPECTED[module], err), err
    sys.modules.pop(module, None)
    status = cli.main(["plan", "tiny", "--gpu", "h100", "--devices", "1", *sets(*MICRO, block)])
    err = capsys.readouterr().err
    assert status == cli.EXIT_USER_ERROR, err
    assert __import__("re").search(EXPECTED[module], err), err


@pytest.mark.slow  # an end-to-end run of 46 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_token_ids_past_the_vocabulary_name_the_cache_not_diverged_weights(tmp_path, capsys):
    import numpy as np

    cache = tmp_path / "cache"
    run = ["train", "tiny", *sets(*MICRO, "data.source=builtin:stdlib:400000", "train.steps=1",
                                  f"data.cache_dir={cache}")]
    assert cli.main([*run, "--set", f"checkpoint.dir={tmp_path / 'first'}"]) == 0
    (rows_file,) = (cache / "packed").glob("*/train.npy")
    rows = np.load(rows_file, mmap_mode="r+")
    rows[:] = 1000           # past the model's 512 embedding rows, as a damaged cache may hold
    rows.flush()
    del rows
    capsys.readouterr()
    assert cli.main([*run, "--set", f"checkpoint.dir={tmp_path / 'second'}"]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "token id 1000, outside the model's vocabulary (0..511)" in err and str(rows_file.parent) in err, err
    assert "diverged" not in err


@pytest.mark.parametrize("inside", ["", "checkpoints", "checkpoints/1"])
def test_init_from_inside_its_own_checkpoint_dir_says_so(inside, tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / inside).mkdir(parents=True, exist_ok=True)
    status = cli.main(["train", "tiny", *sets(*MICRO, "data.source=builtin:stdlib:400000", f"checkpoint.dir={run_dir}",
                                              f"checkpoint.init_from={run_dir / inside}")])
    err = capsys.readouterr().err
    assert status == cli.EXIT_USER_ERROR
    assert "is inside this run's own checkpoint.dir" in err and "leave checkpoint.init_from unset" in err, err


def test_out_of_memory_with_the_users_settings_names_them_and_the_bytes(tmp_path, capsys, monkeypatch):
    import jax

    from spillway.recipes.train import loop

    def exhausted(*args, **kwargs):   # what XLA raises when an allocation cannot be made
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 40000000000000 bytes.")
    monkeypatch.setattr(loop, "setup", exhausted)
    status = cli.main(["train", "tiny", *sets(*MICRO, "data.source=builtin:stdlib:400000", "train.global_batch=16",
                                              f"data.cache_dir={tmp_path / 'cache'}",
                                              f"checkpoint.dir={tmp_path / 'run'}")])
    err = capsys.readouterr().err
    assert status == cli.EXIT_USER_ERROR and "internal error" not in err, err
    assert "out of memory on the host (40,000,000,000,000 bytes (37252.9 GiB) asked for)" in err, err
    assert "num_layers=2" in err and "train.global_batch=16 x data.seq_len=32" in err and "spillway plan tiny" in err


@pytest.mark.slow  # an end-to-end run of 36 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_unfinished_folder(tmp_path, capfd, monkeypatch):
    import errno

    from spillway.recipes.train import checkpoint_items

    def disk_full(path, text):   # the recipe file, written in orbax's background commit like the arrays
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(checkpoint_items, "_write_text", disk_full)
    run_dir = tmp_path / "run"
    status = cli.main(["train", "tiny", *sets(*MICRO, "data.source=builtin:stdlib:400000", "train.steps=3",
                                              "checkpoint.every_steps=2", f"data.cache_dir={tmp_path / 'cache'}",
                                              f"checkpoint.dir={run_dir}")])
    err = capfd.readouterr().err
    assert status == cli.EXIT_USER_ERROR
    assert "Traceback" not in err and "ERROR:absl" not in err, err[:3000]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"spillway train: error: {run_dir / 'checkpoints' / '2'}: the async save failed"), last
    assert "2.orbax-checkpoint-tmp was removed" in last and "No space left on device in" in last
    assert "free space there and a rerun starts over" in last
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_a_slow_tokenizers_folder_is_named_as_one(tmp_path, capsys):
    """A new user's finding: a folder of a slow GPT-2 tokenizer (vocab.json, merges.txt) got "holds neither
    tokenizer.json nor tokenizer.model; or point at a local copy", a dangling "or" that named nothing wrong."""
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    code = cli.main(["train", "tiny", "--set", f"data.tokenizer={folder}", "--set", f"checkpoint.dir={tmp_path / 'r'}"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_USER_ERROR
    assert "holds neither tokenizer.json nor tokenizer.model (vocab.json and merges.txt are a slow tokenizer's" in line
    assert "save_pretrained" in line and "; or point" not in line
