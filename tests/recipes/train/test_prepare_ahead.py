"""`spillway prepare RECIPE`: a run's data tokenized ahead of it, into the cache the run then reads.

Chat/instruct rows with a chat template and a named tokenizer are what `python -m spillway.data` could not
prepare; the run that follows must find them cached, and no run folder may be made before it. A run already
started is refused in one line (it tokenizes with its own copy of the tokenizer).
"""

from spillway.data import train_tokenizer
from spillway.data.instruct_tiny import INSTRUCT_TINY, records
from spillway.recipes import cli


def sets(tmp_path, tokenizer_dir):
    items = [f"data.source={INSTRUCT_TINY}", "data.format=instruct", "data.chat_template=spillway",
             f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128",
             "data.val_fraction=0.2", "model.d_model=32", "model.num_layers=1", "model.num_heads=2",
             "model.num_kv_heads=1", "model.mlp_hidden=64", "model.vocab_size=400", "model.max_seq_len=128",
             "train.steps=1", "train.global_batch=8", "train.eval_every=0", "train.sample_tokens=0",
             f"checkpoint.dir={tmp_path / 'run'}"]
    return [arg for item in items for arg in ("--set", item)]


def test_prepare_fills_the_cache_a_chat_run_reads_and_refuses_a_started_run(tmp_path, capsys):
    tokenizer_dir = tmp_path / "tokenizer"
    texts = [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" for r in records()]
    train_tokenizer(texts, vocab_size=400, cache_dir=tmp_path / "tokenizer-cache").save_to_directory(tokenizer_dir)

    assert cli.main(["prepare", "tiny", *sets(tmp_path, tokenizer_dir)]) == 0
    out = capsys.readouterr().out
    assert "280 examples" in out and "(tokenized, " in out and "ready: `spillway train`" in out
    assert not (tmp_path / "run").exists()   # no run folder before the run

    assert cli.main(["train", "tiny", *sets(tmp_path, tokenizer_dir)]) == 0
    assert "(cached, " in capsys.readouterr().out   # the run read the rows prepare made

    assert cli.main(["prepare", "tiny", *sets(tmp_path, tokenizer_dir)]) == cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'run'} holds a run that has started" in line and "set checkpoint.dir" in line
    # train.resume=false is no way round: `spillway train` refuses a folder holding steps with it
    assert cli.main(["prepare", "tiny", *sets(tmp_path, tokenizer_dir), "--set", "train.resume=false"]) == \
        cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert "holds a run that has started" in line and "resume=false" not in line
    assert cli.main(["train", "tiny", *sets(tmp_path, tokenizer_dir), "--set", "train.resume=false"]) == \
        cli.EXIT_USER_ERROR
    assert "train.resume is false, but this directory holds steps" in capsys.readouterr().err


def test_prepare_refuses_a_folder_a_live_run_holds(tmp_path, capsys):
    """A new user's finding: a run training in the folder before its first checkpoint got "ready: ..." (its lock
    names this live process here); a lock left by a process that is gone is no run."""
    from spillway.recipes.train.run_lock import LOCK_FILENAME, LockOwner

    tokenizer_dir = tmp_path / "tokenizer"
    texts = [f"{r['instruction']}\n{r['output']}" for r in records()]
    train_tokenizer(texts, vocab_size=400, cache_dir=tmp_path / "tokenizer-cache").save_to_directory(tokenizer_dir)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILENAME).write_text(LockOwner.this_process().to_json())
    assert cli.main(["prepare", "tiny", *sets(tmp_path, tokenizer_dir)]) == cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'run'} holds a run training now (pid " in line


def test_a_mixture_warns_of_the_source_it_leaves_unread_only_where_the_user_set_it():
    """tiny_sft's own instruction set is no source the user set: a mixture on it warned of it on every run."""
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.run_data import mixture_replaces

    mixture = "data.mixture=a=1:/data/a,b=1:/data/b"
    assert mixture_replaces(get_recipe("tiny_sft", [mixture])) is None
    assert mixture_replaces(get_recipe("tiny", [mixture])) is None
    assert mixture_replaces(get_recipe("tiny", [mixture, "data.source=/data/mine"])) == "/data/mine"
