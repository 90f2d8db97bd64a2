"""What a failed save leaves: its unfinished folder removed, also one orbax makes just after the removal.

Orbax makes a save's folders from coroutines on an event loop in its own thread, which an error in the
caller's thread does not stop: under load a fresh-clone run found `2.orbax-checkpoint-tmp` made after the
failed save's removal (test_checkpoint_pieces' full-disk test). The removal now watches for it to return,
retries a removal a writer raced, and the save joins the threads it started before removing anything.
"""

import threading
import time

from spillway.recipes.train import save_failures
from spillway.recipes.train.save_failures import SETTLE_S, join_threads_started_since, remove_unfinished


def test_a_folder_made_again_just_after_the_removal_is_removed_too(tmp_path):
    unfinished = tmp_path / "2.orbax-checkpoint-tmp"
    (unfinished / "params").mkdir(parents=True)
    (tmp_path / "1").mkdir()   # the intact step: never touched

    def orbax_thread_late():
        while unfinished.exists():
            time.sleep(0.01)
        time.sleep(SETTLE_S / 3)
        (unfinished / "opt_state").mkdir(parents=True)

    late = threading.Thread(target=orbax_thread_late)
    late.start()
    said = remove_unfinished(tmp_path, 2)
    late.join()
    assert said == "its unfinished folder 2.orbax-checkpoint-tmp was removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_nothing_to_remove_says_so_without_waiting_long(tmp_path):
    started = time.monotonic()
    assert remove_unfinished(tmp_path, 3) == "nothing left behind"
    assert time.monotonic() - started < 5 * SETTLE_S


def test_a_folder_that_keeps_coming_back_ends_the_watch_at_its_limit(tmp_path, monkeypatch):
    """The watch is bounded even while a folder reappears at every look (the first version only checked its
    limit in a quiet moment, so a thread remaking the folder without pause held it forever)."""
    from spillway.recipes.train import save_failures

    monkeypatch.setattr(save_failures, "SETTLE_LIMIT_S", 0.5)
    unfinished = tmp_path / "2.orbax-checkpoint-tmp"
    stop = threading.Event()

    def remaking():
        while not stop.is_set():
            unfinished.mkdir(exist_ok=True)
            time.sleep(0.005)

    thread = threading.Thread(target=remaking)
    thread.start()
    try:
        started = time.monotonic()
        said = remove_unfinished(tmp_path, 2)
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        thread.join()
    assert said.startswith("the unfinished save is left in ") and "2.orbax-checkpoint-tmp" in said


def test_a_removal_a_writer_raced_is_tried_again(tmp_path, monkeypatch):
    """rmtree fails with "Directory not empty" when a file lands in a folder while it is being removed; that
    folder was kept (and named for the user to delete) at the first failure, not tried again."""
    unfinished = tmp_path / "2.orbax-checkpoint-tmp"
    (unfinished / "params").mkdir(parents=True)
    tries, rmtree = [], save_failures.shutil.rmtree

    def raced_once(path):
        tries.append(path)
        if len(tries) == 1:
            raise OSError(39, "Directory not empty", str(path))
        rmtree(path)

    monkeypatch.setattr(save_failures.shutil, "rmtree", raced_once)
    assert remove_unfinished(tmp_path, 2) == "its unfinished folder 2.orbax-checkpoint-tmp was removed"
    assert len(tries) == 2 and not unfinished.exists()


def test_threads_a_failed_save_started_are_joined_before_anything_is_removed(tmp_path):
    before = set(threading.enumerate())
    wrote = threading.Event()

    def commit_thread():
        time.sleep(0.3)
        (tmp_path / "2.orbax-checkpoint-tmp" / "meta").mkdir(parents=True)
        wrote.set()

    threading.Thread(target=commit_thread, name="late-commit").start()
    assert join_threads_started_since(before, limit_s=10.0) == [] and wrote.is_set()
    started = threading.Event()
    stuck = threading.Thread(target=started.wait, name="never-ends", daemon=True)
    stuck.start()
    begun = time.monotonic()
    assert join_threads_started_since(before, limit_s=0.2) == ["never-ends"]
    assert time.monotonic() - begun < 2.0
    started.set()


def test_callbacks_on_orbax_closed_event_loop_and_its_abandoned_tasks_are_not_printed(monkeypatch):
    """A full disk during an async save: the run's one-line error came with about 20 tracebacks of
    "Event loop is closed" (the abandoned writes' callbacks, through sys.unraisablehook) and asyncio's "Task
    exception was never retrieved" for orbax's task. Other unraisable errors and log records still pass."""
    import asyncio
    import logging
    import sys
    import types

    def unraisable(error):
        return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=error.__traceback__,
                                     err_msg=None, object=None)

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as error:
        closed = unraisable(error)
    try:
        raise RuntimeError("Event loop is closed")   # the same words from elsewhere: passed on
    except RuntimeError as error:
        elsewhere = unraisable(error)
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    save_failures.quiet_orbax_error_logs()
    sys.unraisablehook(closed)
    sys.unraisablehook(elsewhere)
    assert seen == [elsewhere]

    def record(message):
        return logging.LogRecord("asyncio", logging.ERROR, "/usr/lib/python3/asyncio/base_events.py", 1, message,
                                 None, None)
    orbax_task = record("Task exception was never retrieved\nfuture: <Task finished coro=<async_serialize_from_"
                        "host() done, defined at /v/lib/orbax/checkpoint/_src/serialization/serialization.py:190>>")
    other_task = record("Task exception was never retrieved\nfuture: <Task finished coro=<mine() done, defined at "
                        "/home/me/app.py:3>>")
    asyncio_filter = save_failures.OrbaxTaskLogFilter()
    assert not asyncio_filter.filter(orbax_task) and asyncio_filter.filter(other_task)
    assert any(isinstance(f, save_failures.OrbaxTaskLogFilter) for f in logging.getLogger("asyncio").filters)
