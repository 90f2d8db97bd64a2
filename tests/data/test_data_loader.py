"""BatchLoader: process-count independence, exact resume, epoch rollover, errors."""

import json

import numpy as np
import pytest

from spillway.data import BatchLoader, eval_batches

SEQ = 5


def _rows(count: int) -> np.ndarray:
    # Row i is filled with i, so a batch's rows can be read back as indices.
    return np.repeat(np.arange(count, dtype=np.uint16)[:, None], SEQ, axis=1)


def _take(loader: BatchLoader, steps: int) -> list[np.ndarray]:
    return [next(loader) for _ in range(steps)]


def test_batches_are_int32_local_slices():
    loader = BatchLoader(_rows(20), global_batch_size=4, seed=0, process_index=1, process_count=2)
    batch = next(loader)
    assert batch.dtype == np.int32 and batch.shape == (2, SEQ)


def test_processes_together_see_the_single_process_batches():
    rows = _rows(22)  # 5 batches per epoch, 2 rows left over
    single = _take(BatchLoader(rows, global_batch_size=4, seed=7), 13)
    halves = [
        _take(BatchLoader(rows, global_batch_size=4, seed=7, process_index=i, process_count=2), 13)
        for i in range(2)
    ]
    for step, batch in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([halves[0][step], halves[1][step]]), batch)


def test_resume_from_state_continues_exactly():
    rows = _rows(20)
    original = BatchLoader(rows, global_batch_size=4, seed=3)
    _take(original, 7)  # mid-epoch 1 (5 batches per epoch)
    state = json.loads(json.dumps(original.state()))
    assert state["epoch"] == 1 and state["position"] == 2 and state["seed"] == 3
    resumed = BatchLoader(rows, global_batch_size=4, seed=3, process_index=0, process_count=1)
    resumed.restore(state)
    for expected, actual in zip(_take(original, 10), _take(resumed, 10)):
        np.testing.assert_array_equal(expected, actual)


def test_resume_on_a_different_process_count():
    rows = _rows(24)
    original = BatchLoader(rows, global_batch_size=4, seed=1)
    _take(original, 3)
    state = original.state()
    halves = []
    for index in range(2):
        loader = BatchLoader(rows, global_batch_size=4, seed=1, process_index=index, process_count=2)
        loader.restore(state)
        halves.append(next(loader))
    np.testing.assert_array_equal(np.concatenate(halves), next(original))


def test_epochs_cover_distinct_rows_and_reshuffle():
    rows = _rows(12)
    loader = BatchLoader(rows, global_batch_size=4, seed=0)
    assert loader.batches_per_epoch == 3
    epochs = [np.concatenate(_take(loader, 3))[:, 0] for _ in range(3)]
    assert loader.epoch == 2
    for seen in epochs:
        assert sorted(seen) == list(range(12))  # each epoch visits every row once
    assert not np.array_equal(epochs[0], epochs[1])
    next(loader)
    assert loader.epoch == 3 and loader.position == 1


def test_same_seed_same_order_other_seed_other_order():
    rows = _rows(16)
    a = np.concatenate(_take(BatchLoader(rows, global_batch_size=4, seed=5), 4))
    b = np.concatenate(_take(BatchLoader(rows, global_batch_size=4, seed=5), 4))
    c = np.concatenate(_take(BatchLoader(rows, global_batch_size=4, seed=6), 4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_no_shuffle_is_in_order_and_eval_batches_make_one_pass():
    rows = _rows(10)
    batches = _take(BatchLoader(rows, global_batch_size=4, shuffle=False), 2)
    assert np.concatenate(batches)[:, 0].tolist() == list(range(8))
    passes = [
        list(eval_batches(rows, global_batch_size=4, process_index=i, process_count=2)) for i in range(2)
    ]
    assert len(passes[0]) == 2
    assert np.concatenate([passes[0][1], passes[1][1]])[:, 0].tolist() == [4, 5, 6, 7]


def test_memory_mapped_uint16_rows(tmp_path):
    np.save(tmp_path / "rows.npy", _rows(8))
    rows = np.load(tmp_path / "rows.npy", mmap_mode="r")
    batch = next(BatchLoader(rows, global_batch_size=4, seed=0))
    assert batch.dtype == np.int32 and isinstance(batch, np.ndarray) and not isinstance(batch, np.memmap)


def test_indivisible_global_batch_is_rejected():
    with pytest.raises(ValueError, match="global_batch_size 6 is not divisible by process_count 4"):
        BatchLoader(_rows(20), global_batch_size=6, process_count=4)


def test_too_few_rows_for_a_batch_is_rejected():
    with pytest.raises(ValueError, match="only 3 rows for a global batch of 4"):
        BatchLoader(_rows(3), global_batch_size=4)


def test_bad_process_index_and_shape_are_rejected():
    with pytest.raises(ValueError, match="process_index 2 is outside \\[0, 2\\)"):
        BatchLoader(_rows(8), global_batch_size=4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len \\+ 1\\] array, got shape \\(8,\\)"):
        BatchLoader(np.arange(8), global_batch_size=4)


def test_state_from_other_data_or_settings_is_refused():
    state = BatchLoader(_rows(20), global_batch_size=4, seed=0).state()
    with pytest.raises(ValueError, match="num_rows: saved 20, now 24"):
        BatchLoader(_rows(24), global_batch_size=4, seed=0).restore(state)
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        BatchLoader(_rows(20), global_batch_size=4, seed=1).restore(state)


@pytest.mark.parametrize("state, says", [
    ({"nonsense": 1}, r"'epoch' is None, not a whole number from 0"),
    ({"epoch": 0, "position": -5}, r"'position' is -5, not a whole number from 0 to 5"),
    ({"epoch": 0, "position": 99999}, r"'position' is 99999, not a whole number from 0 to 5"),
    ({"epoch": "1", "position": 0}, r"'epoch' is '1'"),
    ([0, 1], r"the loader state is a JSON list, not an object"),
])
def test_a_damaged_loader_state_is_named_not_a_key_error_or_a_wrong_position(state, says):
    """A position past the epoch trained on other batches without a word, a negative one then divided by zero,
    a missing field was a KeyError: each is a DamagedLoaderState (a resume sets that step aside)."""
    from spillway.data.loader import BatchLoader, DamagedLoaderState

    loader = BatchLoader(np.arange(40 * 5).reshape(40, 5), global_batch_size=8, seed=0)
    with pytest.raises(DamagedLoaderState, match=says):
        loader.restore(state)
    loader.restore({**loader.state(), "epoch": 2, "position": 5})   # the epoch's end is a position
    assert loader.position == 5 and next(loader).shape == (8, 5) and loader.epoch == 3
