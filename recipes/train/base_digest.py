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
to the base, its size, and 64 KiB at its start, middle and end; and in a
safetensors file, 4 KiB at the start and at the end of every tensor's data
(from the file's header). That is cheap at any model size (a few MiB for an
8B: one read per tensor), unchanged by a copy or a move (no modification
times, no absolute paths), and changed by other weights: a tensor trained
since differs at its start and end (a fine-tune merged into a few projections
of the base too, which the three file windows alone missed when none of
those tensors lay under them), and a spillway save names its data files
afresh. Digests are "v2:..." since the per-tensor reads; one kept before
("v1", 32 hex digits) is compared by the reads it was taken with
(`holds_digest`), so older runs resume. Since "v3:" a Hugging Face folder's
Mistral-format files (`consolidated.safetensors` beside transformers' shards,
which only mistral-inference reads) are left out: deleting that redundant
copy, or downloading it later, changes no weight the run reads, and was
refused as another base.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from spillway.models.hf_sources import mistral_native_files
from spillway.recipes.train.checkpoint_items import PARAMS

CHUNK_BYTES = 64 << 10
TENSOR_EDGE_BYTES = 4 << 10
VERSION = "v3:"
PER_TENSOR = "v2:"   # every tensor read, Mistral's own files too


def _files_of(base: Path, read_only: bool) -> list[Path]:
    """The files digested; `read_only`: without the Mistral-format files the load never reads."""
    if (base / PARAMS).is_dir():   # a spillway step: its weights only (not its optimizer state)
        return sorted(path for path in (base / PARAMS).rglob("*") if path.is_file())
    unread = set(mistral_native_files(base)) if read_only else set()
    return sorted([*(set(base.glob("*.safetensors")) - unread), *base.glob("*.safetensors.index.json"),
                   base / "config.json"])


def _tensor_spans(file, size: int) -> list[tuple[int, int]]:
    """(start, end) in the file of every tensor's data of a safetensors file, by name; [] where its header
    cannot be read (the file windows still cover it, and the load names a damaged file)."""
    try:
        file.seek(0)
        header_bytes = struct.unpack("<Q", file.read(8))[0]
        if header_bytes > size:
            return []
        header = json.loads(file.read(header_bytes))
        return [(8 + header_bytes + int(entry["data_offsets"][0]), 8 + header_bytes + int(entry["data_offsets"][1]))
                for name, entry in sorted(header.items()) if name != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError):
        return []


def _digest(base_dir: Path, per_tensor: bool, read_only: bool = False) -> str:
    digest = hashlib.sha256()
    for path in _files_of(base_dir, read_only):
        if not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.relative_to(base_dir)}\0{size}\0".encode())
        with open(path, "rb") as file:
            windows = [(offset, CHUNK_BYTES) for offset in
                       sorted({0, max(0, size // 2 - CHUNK_BYTES // 2), max(0, size - CHUNK_BYTES)})]
            if per_tensor and path.suffix == ".safetensors":
                windows += [(offset, min(TENSOR_EDGE_BYTES, end - start)) for start, end in _tensor_spans(file, size)
                            for offset in sorted({start, max(start, end - TENSOR_EDGE_BYTES)})]
            for offset, length in windows:
                file.seek(offset)
                digest.update(file.read(length))
    return digest.hexdigest()[:32]


def base_digest(base_dir: str | Path) -> str:
    """The digest of the base weights in `base_dir` (a step folder or a Hugging Face folder): module docstring."""
    return VERSION + _digest(Path(base_dir).expanduser(), per_tensor=True, read_only=True)


def holds_digest(base_dir: str | Path, expected: str) -> bool:
    """Whether the base in `base_dir` has the digest `expected`, taken now as `expected` was taken (a digest kept
    before the per-tensor reads is a legacy one: module docstring)."""
    if expected.startswith(VERSION):
        return base_digest(base_dir) == expected
    if expected.startswith(PER_TENSOR):
        return PER_TENSOR + _digest(Path(base_dir).expanduser(), per_tensor=True) == expected
    return _digest(Path(base_dir).expanduser(), per_tensor=False) == expected
