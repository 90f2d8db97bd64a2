"""A digest of a LoRA run's base weights as their files are, so that a base replaced under the adapters is refused.

A LoRA run's checkpoints hold its adapters only; the base is read again from
`checkpoint.init_from` at every start and by `spillway generate` and
`spillway export`. Its path is pinned when the run starts (lora_state.pin_base),
but another model written at that path (a source run trained again into its
folder, a Hugging Face folder downloaded again at another revision) was read
without a word: the adapters on weights they were not trained with, which is
another model. The digest is taken when the run first starts, kept in the
recipe saved with every step (`checkpoint.init_from_digest`), and compared at
every later read of the base; a run saved before it was kept has none and is
not checked.

What it reads of the base (a spillway step folder's `params` item, or an
`hf:` folder's safetensors files and config.json): each file's path relative
to the base, its size, and 64 KiB at its start, middle and end. That is cheap
at any model size (a few files either way), unchanged by a copy or a move (no
modification times, no absolute paths), and changed by other weights: the
bytes of several tensors differ, and a spillway save names its data files
afresh.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from spillway.recipes.train.checkpoint_items import PARAMS

CHUNK_BYTES = 64 << 10


def _files_of(base: Path) -> list[Path]:
    if (base / PARAMS).is_dir():   # a spillway step: its weights only (not its optimizer state)
        return sorted(path for path in (base / PARAMS).rglob("*") if path.is_file())
    return sorted([*base.glob("*.safetensors"), *base.glob("*.safetensors.index.json"), base / "config.json"])


def base_digest(base_dir: str | Path) -> str:
    """The digest of the base weights in `base_dir` (a step folder or a Hugging Face folder): module docstring."""
    base_dir = Path(base_dir).expanduser()
    digest = hashlib.sha256()
    for path in _files_of(base_dir):
        if not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.relative_to(base_dir)}\0{size}\0".encode())
        with open(path, "rb") as file:
            for offset in sorted({0, max(0, size // 2 - CHUNK_BYTES // 2), max(0, size - CHUNK_BYTES)}):
                file.seek(offset)
                digest.update(file.read(CHUNK_BYTES))
    return digest.hexdigest()[:32]
