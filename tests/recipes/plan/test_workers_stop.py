"""`spillway plan` stopped any way leaves no compile process running and no request file; outputs are
checked before compiling.

The parent here is a real process running the planner's `workers.run_children` over
two stand-in compile processes (a module that only sleeps), so what is tested
is what the kernel and the parent do: SIGKILL (the parent cannot clean up:
the children's parent-death signal kills them), SIGTERM and SIGINT (the
parent kills them itself and leaves at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spillway.recipes import cli

SLEEPY_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.stdin.read()
    open(os.path.join(sys.argv[1], f"pid-{os.getpid()}"), "w").close()
    time.sleep(120)
""")

PARENT = textwrap.dedent("""
    import signal, sys
    # As `spillway plan` started from a terminal: a suite started in the background inherits SIGINT ignored
    # (a shell without job control does that), and Python keeps an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from spillway.recipes.plan import plugin, workers
    plugin.missing_reason = lambda: None            # the stand-in child needs no toolchain
    real = workers.run_in_compile_process
    workers.run_in_compile_process = lambda module, args, **kw: real("sleepy_child", [sys.argv[1]], **kw)
    workers.run_children({"candidates": [{}, {}], "verify_full_codegen": []}, workers=2)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")   # a zombie has exited (nothing may reap it in a container)


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_stopping_the_planner_stops_its_compile_processes_and_leaves_no_request_file(how, tmp_path):
    (tmp_path / "sleepy_child.py").write_text(SLEEPY_CHILD)
    pids_dir, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids_dir.mkdir(), tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pids_dir)], env=env, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert wait_until(lambda: len(list(pids_dir.iterdir())) == 2, 60), parent.stderr and "children did not start"
        children = [int(p.name.removeprefix("pid-")) for p in pids_dir.iterdir()]
        assert all(alive(pid) for pid in children)
        started = time.monotonic()
        parent.send_signal(how)
        # well under the stand-in children's 120 s: the parent did not wait for their "compile" (generous,
        # since a loaded 2-core machine starts and stops Python processes slowly)
        parent.wait(timeout=60)
        assert time.monotonic() - started < 40
        assert wait_until(lambda: not any(alive(pid) for pid in children), 5), \
            f"compile processes outlived the planner after {how.name}"
        assert list(tmp.glob("spillway-plan-*.json")) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in [int(p.name.removeprefix("pid-")) for p in pids_dir.iterdir()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_unwritable_png_path_fails_before_compiling(tmp_path, capsys, monkeypatch):
    from spillway.recipes.plan import commands

    def no_compiles(*args, **kwargs):
        raise AssertionError("compiled before checking --png")
    monkeypatch.setattr(commands, "plan", no_compiles)
    (tmp_path / "afile").write_text("")
    status = cli.main(["plan", "tiny", "--gpu", "h100", "--devices", "1", "--png", str(tmp_path / "afile" / "plan.png")])
    assert status == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"--png {tmp_path / 'afile' / 'plan.png'}: {tmp_path / 'afile'} is a file, not a folder" in err
    assert cli.main(["plan", "tiny", "--gpu", "h100", "--devices", "1", "--png",
                     str(tmp_path / "nowhere" / "plan.png")]) == cli.EXIT_USER_ERROR
    assert "does not exist" in capsys.readouterr().err
    # an empty --png (an unset shell variable) drew nothing and said nothing
    assert cli.main(["plan", "tiny", "--gpu", "h100", "--devices", "1", "--png", ""]) == cli.EXIT_USER_ERROR
    assert "--png is empty: give the image file to write" in capsys.readouterr().err


@pytest.mark.parametrize("name, says", [("plan.txt", "'txt' is not an image format matplotlib writes"),
                                        ("plan", "the name has no image suffix")])
def test_a_png_path_in_a_format_matplotlib_cannot_write_fails_before_compiling(name, says, tmp_path, capsys,
                                                                                monkeypatch):
    from spillway.recipes.plan import commands

    def no_compiles(*args, **kwargs):
        raise AssertionError("compiled before checking the --png format")
    monkeypatch.setattr(commands, "plan", no_compiles)
    status = cli.main(["plan", "tiny", "--gpu", "h100", "--devices", "1", "--png", str(tmp_path / name)])
    assert status == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"--png {tmp_path / name}: {says}; give one of " in err and ".png" in err and ".pdf" in err
    assert not (tmp_path / name).exists()


PROGRESS_CHILD = textwrap.dedent("""
    import json, sys, time
    from spillway.recipes.plan.subprocess_runner import report_progress, serve_compile_process

    def main(argv):
        request = json.load(sys.stdin)
        results = []
        for index, _ in enumerate(request["candidates"]):
            results.append({"error": f"stand-in {index}", "seconds": 0.0})
            print("an XLA warning on stderr", file=sys.stderr, flush=True)
            report_progress({"index": index, "result": results[-1]})
            time.sleep(3)
        return {"results": results, "full_codegen": {}, "searches": None, "seconds": 3.0, "setup_seconds": 0.0}

    serve_compile_process(main)
""")


def test_each_finished_compile_reaches_the_planner_while_the_process_still_runs(tmp_path, monkeypatch):
    from spillway.recipes.plan import plugin, workers

    (tmp_path / "progress_child.py").write_text(PROGRESS_CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(plugin, "missing_reason", lambda: None)   # the stand-in needs no toolchain
    real = workers.run_in_compile_process
    monkeypatch.setattr(workers, "run_in_compile_process",
                        lambda module, args, **kw: real("progress_child", [], **kw))
    heard = []
    answer = workers.run_children({"candidates": [{}, {}]}, workers=1,
                                  on_progress=lambda index, result: heard.append((index, result, time.monotonic())))
    finished = time.monotonic()
    assert [(index, result["error"]) for index, result, _ in heard] == [(0, "stand-in 0"), (1, "stand-in 1")]
    assert finished - heard[0][2] > 4   # the first line came while the second "compile" still ran
    assert [r["error"] for r in answer["results"]] == ["stand-in 0", "stand-in 1"]
