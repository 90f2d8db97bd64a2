"""Where the Hugging Face engine (models/hf.py) reads tensors from: a checkpoint's safetensors files or an in-memory
state dict, seen under the names a family's table uses.

    open_source(source)            a context: {name: array} or the memory-mapped files of a checkpoint
                                   directory (one file, or the shards its index lists), read lazily
    with_base_prefix(source, table)    a checkpoint saved from the base model (names without the
                                   table's prefix) or a tower of a larger one, under the table's names
    in_table_layout(source, table, config)   another layout of the same weights (HFTable.views: each
                                   checkpoint name a slice of a fused tensor) under the table's names

Every source answers names(), shape(name) and get(name); the safetensors and
dict sources also get_part(name, index), which reads only a slice.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or config that spillway cannot read as asked (the message says why)."""


class NoOutputHeadError(HFCheckpointError):
    """A checkpoint saved from a model without an output head (a base model, a classifier): its weights are not a
    causal LM's, whatever its config.json says."""


class _DictSource:
    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(np.shape(self.tensors[name]))

    def get(self, name):
        return np.asarray(self.tensors[name])

    def get_part(self, name, index):
        return np.asarray(self.tensors[name])[index]


class _SafetensorsSource:
    def __init__(self, files: dict[str, Any], paths: dict[str, Path] | None = None):
        self.files = files  # name -> open safe_open handle
        self.paths = paths or {}  # name -> the file holding it, for messages

    def file_of(self, name):
        return self.paths.get(name)

    def names(self):
        return list(self.files)

    def shape(self, name):
        return tuple(self.files[name].get_slice(name).get_shape())

    def get(self, name):
        return self.files[name].get_tensor(name)

    def get_part(self, name, index):
        """Only the slice `index` of the tensor is read from the file."""
        return self.files[name].get_slice(name)[index] if index else self.get(name)


class _PrefixedSource:
    """A checkpoint whose names lack the table's `base_prefix`, seen under the prefixed names."""

    def __init__(self, source, prefix: str):
        self.source, self.prefix = source, prefix

    def names(self):
        return [self.prefix + name for name in self.source.names()]

    def shape(self, name):
        return self.source.shape(name.removeprefix(self.prefix))

    def get(self, name):
        return self.source.get(name.removeprefix(self.prefix))

    def file_of(self, name):
        return getattr(self.source, "file_of", lambda _: None)(name.removeprefix(self.prefix))


class _TowerSource:
    """The tensors of one tower of a larger checkpoint, under the table's names (`HFTable.tower_prefixes`)."""

    def __init__(self, source, prefixes: tuple[tuple[str, str], ...]):
        self.source = source
        self.to_source: dict[str, str] = {}
        for name in source.names():
            for theirs, ours in prefixes:
                if name.startswith(theirs):
                    self.to_source.setdefault(ours + name[len(theirs):], name)
                    break

    def names(self):
        return list(self.to_source)

    def shape(self, name):
        return self.source.shape(self.to_source[name])

    def get(self, name):
        return self.source.get(self.to_source[name])


def _get_part(source, name: str, index: tuple):
    part = getattr(source, "get_part", None)
    return part(name, index) if part is not None else np.asarray(source.get(name))[index]


def _indexed_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of array[index] for an index of ints and slices."""
    out = []
    for dim, size in enumerate(shape):
        if dim >= len(index):
            out.append(size)
        elif isinstance(index[dim], slice):
            out.append(len(range(size)[index[dim]]))
    return tuple(out)


class _ViewSource:
    """A checkpoint in another layout seen under the table's names (`HFTable.views`): each viewed name a
    slice of a tensor the checkpoint holds; the tensors viewed are hidden, everything else passes through."""

    def __init__(self, source, views: dict[str, tuple[str, tuple]]):
        present = set(source.names())
        self.source = source
        self.views = {name: view for name, view in views.items() if view[0] in present}
        viewed = {view[0] for view in self.views.values()}
        self._names = [n for n in source.names() if n not in viewed] + list(self.views)

    def names(self):
        return self._names

    def shape(self, name):
        if name in self.views:
            fused, index = self.views[name]
            return _indexed_shape(self.source.shape(fused), index)
        return self.source.shape(name)

    def get(self, name):
        if name in self.views:
            return _get_part(self.source, *self.views[name])
        return self.source.get(name)

    def file_of(self, name):
        name = self.views.get(name, (name,))[0]
        return getattr(self.source, "file_of", lambda _: None)(name)


def in_table_layout(source, table, config):
    """`source` through the table's other layout (`HFTable.views`) when it holds any tensor of that layout."""
    if table.views is None:
        return source
    views = table.views(config)
    fused = {view[0] for view in views.values()}
    if not any(name in fused for name in source.names()):
        return source
    return _ViewSource(source, views)


def with_base_prefix(source, table):
    """`source` as the table names it: prefixed when it was saved from the base model (no name has the prefix),
    or its tower's tensors renamed when it is a larger checkpoint holding the table's model as one tower."""
    towers = [theirs for theirs, ours in table.tower_prefixes if theirs != ours]
    if towers and any(n.startswith(tuple(towers)) for n in source.names()):
        return _TowerSource(source, table.tower_prefixes)
    if table.base_prefix and not any(n.startswith(table.base_prefix) for n in source.names()):
        return _PrefixedSource(source, table.base_prefix)
    return source


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index lists, else its *.safetensors (a FileNotFoundError or
    HFCheckpointError saying what is missing or doubled)."""
    if not path.exists():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {path}: the path does not exist")
    if path.is_file():
        return [path]
    index = path / SAFETENSORS_INDEX_FILE
    if index.exists():
        files = indexed_shards(index)
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {absent}")
        strays = sorted(set(path.glob("*.safetensors")) - set(files) - set(mistral_native_files(path)))
        if strays:
            # transformers reads model.safetensors where the index's shards are another checkpoint: refuse both
            raise HFCheckpointError(
                f"{path} holds two checkpoints: the shards {index.name} lists ({listed(files)}) and "
                f"{listed(strays)}, which it does not list; keep one of them (delete the other) and load again")
        return files
    native = mistral_native_files(path)
    files = sorted(set(path.glob("*.safetensors")) - set(native)) or native
    if files and files == native:
        raise HFCheckpointError(f"{path} holds only Mistral's own format ({listed(files)}, read with params.json "
                                f"by mistral-inference), which transformers does not read: fetch the repository's "
                                f"model-*.safetensors and {SAFETENSORS_INDEX_FILE} beside it")
    if not files:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
        # transformers writes safetensors by default: one save_pretrained where torch is converts a .bin checkpoint;
        # its tokenizer is saved beside it, or the converted folder has none to train or export with
        hint = (f" (found {others}: only safetensors checkpoints are read; convert it where torch and transformers "
                f"are installed: python -c \"from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; "
                f"old, new = '{path}', '{path}-safetensors'; M.from_pretrained(old).save_pretrained(new); "
                f"T.from_pretrained(old).save_pretrained(new)\")") if others else ""
        raise FileNotFoundError(f"no *.safetensors files in {path}{hint}")
    return files


def mistral_native_files(path: Path) -> list[Path]:
    """Mistral's own-format weights (consolidated.safetensors, consolidated-00001-of-00002.safetensors), which its
    repositories hold beside transformers' shards: the same model under other names, that transformers never reads."""
    return sorted(path.glob("consolidated*.safetensors"))


def indexed_shards(index: Path) -> list[Path]:
    """The shard files a model.safetensors.index.json lists (beside it), sorted."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFCheckpointError(f"{index} is not a safetensors index (JSON with a weight_map): {err}") from None
    return [index.parent / f for f in sorted(set(weight_map.values()))]


def listed(files: Sequence[Path]) -> str:
    names = [f.name for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _safe_open(stack: contextlib.ExitStack, file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return stack.enter_context(safe_open(str(file), framework="numpy"))
    except (SafetensorError, OSError) as err:
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({err}); it may be truncated, e.g. "
                                f"by an interrupted download or copy: fetch it again") from None


@contextlib.contextmanager
def open_source(source) -> Iterator[Any]:
    if isinstance(source, Mapping):
        yield _DictSource(source)
        return
    with contextlib.ExitStack() as stack:
        by_name: dict[str, Any] = {}
        paths: dict[str, Path] = {}
        for file in safetensors_files(Path(source)):
            handle = _safe_open(stack, file)
            for name in handle.keys():
                if name in by_name:
                    raise HFCheckpointError(f"tensor {name!r} appears in more than one safetensors file under {source}")
                by_name[name], paths[name] = handle, file
        yield _SafetensorsSource(by_name, paths)
