"""Write a `.npy` array of known shape piece by piece, with ordinary file writes.

Packing writes rows far larger than memory. Filling a memory-mapped output
would do, but every page written stays in the writer's resident set until the
map is closed, so the process's peak memory would again grow with the corpus;
plain `write` calls leave the bytes to the page cache, which the kernel
flushes and reclaims on its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class NpyStreamWriter:
    """A C-order `.npy` file of `shape` and `dtype`, filled by `append` in order.

    Use as a context manager: leaving the block without an exception checks
    that exactly `prod(shape)` values were written, so a short file is an
    error here, not a corrupt array for a later reader.
    """

    def __init__(self, path: str | os.PathLike, shape: tuple[int, ...], dtype: np.dtype):
        self.path = Path(path)
        self.shape = tuple(int(size) for size in shape)
        self.dtype = np.dtype(dtype)
        self.capacity = int(np.prod(self.shape, dtype=np.int64))
        self.written = 0
        self._file = open(self.path, "wb")
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": self.shape}
        np.lib.format.write_array_header_1_0(self._file, header)

    def remaining(self) -> int:
        return self.capacity - self.written

    def append(self, values: np.ndarray) -> None:
        """Write `values` (flattened, cast to the file's dtype) after what is already written."""
        values = np.ascontiguousarray(values, dtype=self.dtype).reshape(-1)
        if len(values) > self.remaining():
            raise ValueError(f"{self.path}: {len(values)} values do not fit in the {self.remaining()} left")
        self._file.write(memoryview(values).cast("B"))
        self.written += len(values)

    def __enter__(self) -> NpyStreamWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._file.close()
        if exc_type is None and self.written != self.capacity:
            raise ValueError(f"{self.path}: wrote {self.written} of {self.capacity} values of shape {self.shape}")
