"""The built-in stdlib corpus: offline, deterministic, capped, library source only."""

import subprocess
import sys
from pathlib import Path

import pytest

from spillway.data import DEFAULT_MAX_BYTES, default_corpus_files, stdlib_root


def test_small_cap_selects_sorted_library_sources():
    files = default_corpus_files(max_bytes=300_000)
    root = stdlib_root()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert files, "the standard library always has .py sources"
    assert relative == sorted(relative)
    assert sum(path.stat().st_size for path in files) <= 300_000
    assert all(name.endswith(".py") for name in relative)
    skipped = {"test", "tests", "site-packages", "idlelib", "encodings", "__pycache__"}
    assert not any(skipped & set(name.split("/")[:-1]) for name in relative)
    assert default_corpus_files(max_bytes=300_000) == files


def test_default_cap_fills_about_eight_megabytes():
    total = sum(path.stat().st_size for path in default_corpus_files())
    assert DEFAULT_MAX_BYTES * 0.9 <= total <= DEFAULT_MAX_BYTES


def test_non_positive_cap_is_rejected():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        default_corpus_files(max_bytes=0)


def test_data_package_imports_no_jax_and_nothing_else_of_ours():
    code = (
        "import sys, data\n"
        "ours = {'jax', 'flax', 'layers', 'models', 'recipes'}\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & ours)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
