"""recipes/train/preemption.py and the stop vote of recipes/train/distributed.py.

The train loop's behaviour on a signal (save, exit 130/143) is tested end to
end in test_run_safety.py (Ctrl-C) and test_train.py (SIGTERM); two processes
with one signalled in test_multiprocess.py. Here: the handler itself, and a
real child process for "a second Ctrl-C quits at once", which no Python-level
check can show.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.train.distributed import StopVote
from spillway.recipes.train.preemption import SIGINT_EXIT_STATUS, SIGTERM_EXIT_STATUS, GroupStop, StopSignals


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_sigterm_and_ctrl_c_set_the_exit_status_and_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    said = []
    with StopSignals(echo=said.append) as signals:
        assert GroupStop(signals, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])).poll() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: signals.exit_status == SIGTERM_EXIT_STATUS)
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: signal.getsignal(signal.SIGINT) is signal.SIG_DFL)  # a second one would kill
        assert signals.exit_status == SIGTERM_EXIT_STATUS  # the larger status wins: both asked to stop
        assert "Ctrl-C again quits at once" in said[0]
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_inherited_ignored_ctrl_c_stays_ignored_and_sigterm_still_stops():
    """A script's background job (or nohup) starts with SIGINT ignored: it ignored Ctrl-C while preparing its
    data, then took one as 'save and stop' once its steps began, and left SIG_IGN behind it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals(echo=lambda text: None) as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            assert wait_for(lambda: signals.exit_status == SIGTERM_EXIT_STATUS)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


CHILD = textwrap.dedent("""
    import sys, time
    from spillway.recipes.train.preemption import StopSignals
    with StopSignals() as signals:
        print("ready", flush=True)
        while True:
            time.sleep(0.05)  # a long step: the loop would save at its end
""")


def test_a_second_ctrl_c_quits_at_once():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert child.stdout.readline().strip() == "ready", child.communicate()[1][-2000:]
        child.send_signal(signal.SIGINT)
        assert "Ctrl-C: saving at the end of this step" in child.stderr.readline() + child.stderr.readline()
        assert child.poll() is None  # the first one only asks
        child.send_signal(signal.SIGINT)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGINT


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2)])
def test_the_stop_vote_is_the_largest_value_replicated(shape):
    mesh = make_mesh(MeshConfig(*shape))
    vote = StopVote(mesh)
    assert int(vote.cast(0)) == 0
    result = vote.cast(SIGINT_EXIT_STATUS)
    assert int(result) == SIGINT_EXIT_STATUS and result.sharding.is_fully_replicated
    assert np.asarray(result).shape == ()


def test_a_vote_taken_now_answers_for_a_signal_poll_would_answer_a_step_later():
    """Several processes: poll() reads the vote cast a step earlier; poll_now(), called after a save where the
    processes wait together anyway, answers for a signal that came during it."""
    from types import SimpleNamespace

    signals = SimpleNamespace(exit_status=0)
    group = GroupStop(signals, make_mesh(MeshConfig(1, 8, 1)))
    group._vote = StopVote(make_mesh(MeshConfig(1, 8, 1)))   # as with jax.process_count() > 1
    assert group.poll() == 0
    signals.exit_status = SIGTERM_EXIT_STATUS   # during the save that follows the step
    assert group.poll_now() == SIGTERM_EXIT_STATUS
