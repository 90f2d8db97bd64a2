"""The `spillway` command's errors: one line on stderr naming the problem, a non-zero exit status,
the traceback only with --debug. Run as a user runs it, in a subprocess, where that is cheap."""

import os
import subprocess
import sys

import pytest

from spillway.layers.errors import ConfigError, SpillwayError
from spillway.recipes import cli
from child_env import child_env


def run_spillway(*argv, cwd, env=None):
    """(exit status, stdout, stderr lines) of `python -m spillway.recipes.cli ARGV`."""
    environment = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    environment = child_env(base=environment, **(env or {}))
    done = subprocess.run([sys.executable, "-m", "spillway.recipes.cli", *argv], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr.splitlines()


@pytest.fixture
def fake_run_dir(tmp_path):
    """A run directory with a tokenizer file and a step folder that holds none of a checkpoint's items."""
    run = tmp_path / "run"
    (run / "checkpoints" / "7").mkdir(parents=True)
    (run / "tokenizer.model").write_bytes(b"not a real model")
    return run


@pytest.mark.parametrize("argv,status,message", [
    (["train", "tiny", "--set", "train.steps=0"], 2, "spillway train: error: --set train.steps=0: "
                                                    "train.steps must be positive, got 0"),
    (["train", "tiny", "--set", "optimizer.total_steps=5"], 2, "optimizer.total_steps cannot be set: "
                                                             "the schedule's length derives from train.steps"),
    (["train", "tiny", "--set", "train.loss_chunk=48"], 2, "train.loss_chunk (48) must divide data.seq_len (128)"),
    (["generate", "RUN", "--prompt", "x", "--tokens", "0"], 2, "spillway generate: error: --tokens must be positive"),
    (["generate", "RUN", "--prompt", "x", "--temperature", "-1"], 2, "--temperature must be zero (greedy) or positive"),
    (["generate", "RUN", "--prompt", "x", "--seed", str(2**70)], 2, "--seed must be in [0, 4294967295]"),
    (["generate", "RUN", "--prompt", "x", "--seed", str(2**32)], 2, "--seed must be in [0, 4294967295] (JAX keeps"),
    (["generate", "RUN", "--prompt", "x"], 2, "spillway generate: error: "),   # the checkpoint error, below
    (["train"], 2, "spillway train: error: the following arguments are required: recipe"),
    (["plan", "tiny", "--devices", "0"], 2, "--devices must be at least 1"),
    (["plan", "tiny", "--gpu", ""], 2, "spillway plan: error: --gpu is empty: name a GPU"),
    (["train", "tiny", "--gpu", "h100"], 2, "--gpu is read by --plan auto only"),
    (["train", "tiny", "--set", "train.steps=1e30"], 2, "expected an integer, got 1e+30 (too large to be exact"),
])
def test_an_error_is_one_line_and_a_non_zero_exit(argv, status, message, fake_run_dir, tmp_path):
    argv = [str(fake_run_dir) if a == "RUN" else a for a in argv]
    code, out, err = run_spillway(*argv, cwd=tmp_path)
    assert code == status, err
    assert len(err) == 1, err
    assert message in err[0]
    assert "Traceback" not in "\n".join(err)


def test_a_checkpoint_error_names_the_path(fake_run_dir, tmp_path):
    code, _, err = run_spillway("generate", str(fake_run_dir), "--prompt", "x", cwd=tmp_path)
    assert code == 2 and len(err) == 1
    # A numbered folder holding none of a step's items is no checkpoint: one line naming where steps were
    # looked for, not a traceback from orbax or the OS.
    assert str(fake_run_dir / "checkpoints") in err[0], err
    assert "no checkpoint found" in err[0], err


def test_debug_shows_the_traceback(tmp_path):
    code, _, err = run_spillway("train", "tiny", "--set", "train.steps=0", "--debug", cwd=tmp_path)
    assert code != 0 and "Traceback (most recent call last)" in "\n".join(err)
    assert "ConfigError" in err[-1]
    code, _, err = run_spillway("train", "tiny", "--set", "train.steps=0", cwd=tmp_path, env={cli.DEBUG_ENV: "1"})
    assert code != 0 and "Traceback (most recent call last)" in "\n".join(err)


# --- the mapping from exception to line, in process ---------------------------------------------

@pytest.mark.parametrize("error,status,line", [
    (ConfigError("train.steps must be positive, got 0"), 2, "train.steps must be positive, got 0"),
    (SpillwayError("loss is nan at step 3:\nstopping"), 2, "loss is nan at step 3: stopping"),
    (PermissionError(13, "Permission denied", "/runs/x"), 2, "/runs/x: Permission denied"),
    (NotADirectoryError(20, "Not a directory", "/a/file/ckpt"), 2, "/a/file/ckpt: Not a directory"),
    (FileNotFoundError("tokenizer model 'x.model' does not exist"), 2, "tokenizer model 'x.model' does not exist"),
    (RuntimeError("orbax: something\nwent wrong"), 1, "internal error, please report it: RuntimeError: orbax: "
                                                     "something went wrong (rerun with --debug for the traceback)"),
])
def test_describe_error(error, status, line):
    assert cli.describe_error(error) == (line, status)


def test_train_failures_from_deep_inside_are_one_line(monkeypatch, capsys):
    """The NaN stop and checkpoint errors are SpillwayErrors: one line, exit 2, whatever raises them."""
    from spillway.recipes.train import loop
    from spillway.recipes.train.checkpoint import CheckpointError
    from spillway.recipes.train.metrics import NonFiniteLossError

    for error in (NonFiniteLossError("loss is nan at step 4: stopping. Try a lower optimizer.learning_rate"),
                  CheckpointError("/runs/tiny/checkpoints/3: restoring failed, the checkpoint is corrupt")):
        def fail(recipe, **kwargs):
            raise error
        monkeypatch.setattr(loop, "train", fail)
        assert cli.main(["train", "tiny", "--set", "train.steps=2"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"spillway train: error: {error}"]


def test_interrupt_is_one_line(monkeypatch, capsys):
    from spillway.recipes.train import loop

    def interrupted(recipe, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "train", interrupted)
    assert cli.main(["train", "tiny"]) == 130
    assert capsys.readouterr().err.splitlines() == ["spillway train: interrupted"]
    # prepare says its finished shards are kept and the same command goes on
    from spillway.recipes.train import prepare_ahead
    monkeypatch.setattr(prepare_ahead, "prepare_ahead", lambda recipe: interrupted(recipe))
    assert cli.main(["prepare", "tiny"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "spillway prepare: interrupted (what it finished is kept: the same command goes on from there)"]
    # export names the file that marks its folder done: adapter_config.json for --adapter, else config.json
    from spillway.recipes import export
    monkeypatch.setattr(export, "export_run", lambda *args, **kwargs: interrupted(None))
    for flags, marker in (([], "config.json"), (["--adapter"], "adapter_config.json")):
        assert cli.main(["export", "runs/x", "out/x", *flags]) == 130
        assert capsys.readouterr().err.splitlines() == [
            f"spillway export: interrupted (the same command writes the export; a folder it had begun to write "
            f"holds no {marker} until then)"]


def test_sigterm_before_the_first_step_cleans_up_as_ctrl_c_does_and_says_so(monkeypatch, capsys, tmp_path):
    """A scheduler's SIGTERM while data was prepared ended the process on the spot, silently, leaving run.lock,
    corpus.json and an empty checkpoints/ behind; Ctrl-C at the same moment removed them and said so."""
    import signal
    import time

    from spillway.recipes.train import loop

    def terminated_while_preparing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)   # the handler raises here
        raise AssertionError("SIGTERM was not raised")

    monkeypatch.setattr(loop, "prepare_run_data", terminated_while_preparing)
    run_dir = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["train", "tiny", "--set", f"checkpoint.dir={run_dir}", "--set", "model.num_layers=1"]) == 143
    assert capsys.readouterr().err.splitlines()[-1] == "spillway train: terminated (SIGTERM)"
    assert not run_dir.exists()   # the folder this run made, its lock with it
    assert signal.getsignal(signal.SIGTERM) is before   # put back once the command ends


def test_an_interrupted_command_line_leaves_past_the_interpreters_teardown(monkeypatch, capsys):
    """From the process's own command line (no argv passed), an interrupted command exits at once: tearing the
    interpreter down under XLA's compiler threads crashed it (SIGSEGV after 'interrupted'). A caller passing
    argv gets the status back instead (the test above)."""
    from spillway.recipes.train import loop

    def interrupted(recipe, **kwargs):
        raise KeyboardInterrupt

    left = []
    monkeypatch.setattr(loop, "train", interrupted)
    monkeypatch.setattr(sys, "argv", ["spillway", "train", "tiny"])
    monkeypatch.setattr(os, "_exit", lambda status: left.append(status))
    cli.main()
    assert left == [130]
    assert capsys.readouterr().err.splitlines() == ["spillway train: interrupted"]


def test_an_amount_with_a_unit_is_refused_naming_the_unit_the_flag_means(capsys):
    """`--hbm-budget 80GB` was argparse's "invalid float value: '80GB'": now the line says the flag's unit."""
    for argv, unit in ((["plan", "tiny", "--hbm-budget", "80GB"], "GiB"),
                       (["plan", "tiny", "--host-ram-gb", "64G"], "GB"),
                       (["train", "tiny", "--host-ram-gb", "64 GB"], "GB")):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is not a number: write the amount in {unit} without a unit" in err[0], err
