"""What a failed save leaves: its unfinished folder removed, also one orbax makes just after the removal.

Orbax makes a save's folders from coroutines on an event loop in its own thread, which an error in the
caller's thread does not stop: under load a fresh-clone run found `2.orbax-checkpoint-tmp` made after the
failed save's removal (test_checkpoint_pieces' full-disk test). The removal now watches for it to return.
"""

import threading
import time

from spillway.recipes.train.save_failures import SETTLE_S, remove_unfinished


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
