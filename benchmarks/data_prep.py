#!/usr/bin/env python
"""Data preparation against corpus size (wall, tokens/s per core, peak memory) and the loader's throughput.

All offline, in one work folder:

1. corpus: two local text corpora written from this interpreter's standard
   library sources (`write_corpus`): every file repeated, each copy with its
   paragraphs shuffled and a header of its own, one document per `.txt`;
   about `--bytes` (default 250 MB) and 8 times smaller.
2. tokenizer: BPE, vocab 4096, trained once on the head of the large corpus
   (the same for both, so only the corpus size differs).
3. prepare: `prepare_tokens(seq_len=256)` of each corpus, cold cache, in a
   fresh child process, for each `--num-proc`. Reported: wall time; CPU
   seconds of every process of the preparation; tokens per CPU second (tokens/s
   per core); peak RSS of the child (its VmHWM) and of the child plus its
   workers (sum of their RSS, sampled from /proc every 0.2 s: an upper bound,
   pages shared between them are counted in each).
   `--baseline REV` runs REV's `data/` package the same way (e.g. the
   in-memory preparation before this benchmark existed).
4. loader: the large corpus repacked at seq_len 8192 (from its cached token
   shards), then batches of `BatchLoader` and of a two-source
   `MixtureLoader` timed with the packed file in the page cache ("warm") and
   after dropping that file's pages (`posix_fadvise(DONTNEED)`, "cold"), in
   tokens/s, to set against what one train step consumes.

Run:  .venv/bin/python benchmarks/data_prep.py --workdir /tmp/spillway-data-bench
      [--bytes 250e6] [--num-proc 1,2] [--baseline cec96d6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_REPO = Path(__file__).resolve().parent.parent
MB = 1e6


def write_corpus(
    folder: str | os.PathLike, total_bytes: int, *, seed: int = 0, max_file_bytes: int | None = None
) -> tuple[int, int]:
    """Write about `total_bytes` of text documents under `folder`; returns (documents, bytes).

    Copy `k` of every standard-library source file (of at most
    `max_file_bytes`, if given) has its paragraphs (runs of lines between
    blank lines) shuffled by `(seed, k, file)` and a header naming the copy,
    so documents are distinct but read like real code. Deterministic for a
    given interpreter.
    """
    from spillway.data import default_corpus_files

    folder = Path(folder)
    sources = [
        (path, path.read_text(encoding="utf-8", errors="replace"))
        for path in default_corpus_files(10**12)
        if max_file_bytes is None or path.stat().st_size <= max_file_bytes
    ]
    written = documents = 0
    copy = 0
    while written < total_bytes:
        directory = folder / f"copy-{copy:03d}"
        directory.mkdir(parents=True, exist_ok=True)
        for index, (path, text) in enumerate(sources):
            paragraphs = re.split(r"\n\s*\n", text)
            if copy:
                rng = np.random.default_rng([seed, copy, index])
                paragraphs = [paragraphs[i] for i in rng.permutation(len(paragraphs))]
            body = f"# {path.name}, copy {copy}\n" + "\n\n".join(paragraphs)
            data = body.encode("utf-8")
            (directory / f"{index:04d}-{path.stem}.txt").write_bytes(data)
            written += len(data)
            documents += 1
            if written >= total_bytes:
                break
        copy += 1
    return documents, written


class _TreeSampler(threading.Thread):
    """Peak summed RSS and last-seen CPU seconds of a process and its descendants, from /proc."""

    def __init__(self, root: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_rss = 0
        self.cpu: dict[int, float] = {}
        self._done = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _stats() -> dict[int, list[str]]:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    text = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                stats[int(entry)] = text[text.rindex(")") + 2 :].split()  # fields from "state" on
        return stats

    def sample(self) -> None:
        stats = self._stats()
        children: dict[int, list[int]] = {}
        for pid, fields in stats.items():
            children.setdefault(int(fields[1]), []).append(pid)
        tree, stack = [], [self.root]
        while stack:
            pid = stack.pop()
            if pid in stats:
                tree.append(pid)
                stack.extend(children.get(pid, []))
        rss = 0
        for pid in tree:
            fields = stats[pid]
            self.cpu[pid] = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
            rss += int(fields[21]) * self._page
        self.peak_rss = max(self.peak_rss, rss)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


# The child: one preparation, measured from inside (CPU of this process and
# its threads, its own peak RSS). `package` is spillway.data or a baseline copy.
_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {path!r})
import importlib
data = importlib.import_module({package!r})
def peak_rss_bytes():  # VmHWM: ru_maxrss would carry the parent's peak over from the fork
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
tokenizer = data.load_tokenizer({tokenizer!r})
before = resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
packed = data.prepare_tokens({source!r}, tokenizer, seq_len={seq_len}, cache_dir={cache!r}, num_proc={num_proc},
                             val_fraction=0.01)
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"wall_s": time.perf_counter() - start, "tokens": int(packed.num_tokens),
                  "documents": int(packed.num_documents), "train_rows": int(len(packed.train)),
                  "val_rows": int(len(packed.val)), "self_cpu_s": usage.ru_utime + usage.ru_stime,
                  "startup_cpu_s": before.ru_utime + before.ru_stime,
                  "self_peak_rss_mb": peak_rss_bytes() / 1e6}}))
"""


def measure_preparation(
    source, tokenizer_path, cache, *, num_proc, seq_len=256, package="spillway.data", path=""
) -> dict:
    """One cold preparation in a fresh child process; see the module docstring for the figures."""
    code = _CHILD.format(path=path or str(_REPO), package=package, tokenizer=str(tokenizer_path),
                         source=str(source), seq_len=seq_len, cache=str(cache), num_proc=num_proc)
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "HF_DATASETS_CACHE": str(Path(cache) / "hf")}
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    sampler = _TreeSampler(child.pid)
    sampler.start()
    stdout, stderr = child.communicate()
    sampler.stop()
    if child.returncode:
        raise RuntimeError(f"preparation of {source} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    # CPU of the preparation: every process of the tree, less the child's start-up
    # (imports, loading the tokenizer). Worker processes' own start-up is included.
    cpu = max(sum(sampler.cpu.values()), result["self_cpu_s"]) - result["startup_cpu_s"]
    result.update(
        process_wall_s=time.perf_counter() - started,
        tree_cpu_s=cpu,
        tree_peak_rss_mb=max(sampler.peak_rss / 1e6, result["self_peak_rss_mb"]),
        num_proc=num_proc,
    )
    result["tokens_per_cpu_s"] = result["tokens"] / result["tree_cpu_s"]
    result["tokens_per_wall_s"] = result["tokens"] / result["wall_s"]
    return result


def _drop_from_page_cache(path: Path) -> None:
    # Dirty pages are not dropped: write them out first. Only this file's pages
    # go, so other work on the machine keeps its cache.
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _time_batches(loader, steps: int) -> float:
    next(loader)
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return time.perf_counter() - start


def measure_loaders(large: Path, small: Path, *, steps: int) -> list[dict]:
    """Tokens/s of BatchLoader and MixtureLoader over memory-mapped rows, warm and cold page cache.

    `large` and `small` are packed folders. Each measurement maps them afresh:
    a page that an earlier measurement mapped would survive the cache drop.
    """
    from spillway.data import BatchLoader, MixtureLoader, PackedData

    results = []
    for global_batch in (1, 8):
        for temperature in ("cold", "warm"):
            for kind in ("BatchLoader", "MixtureLoader"):
                if temperature == "cold":
                    _drop_from_page_cache(large / "train.npy")
                    _drop_from_page_cache(small / "train.npy")
                rows, other = PackedData.load(large).train, PackedData.load(small).train
                seed = 1 if temperature == "cold" else 2  # the warm run reads the rows the cold one did not
                if kind == "BatchLoader":
                    loader = BatchLoader(rows, global_batch_size=global_batch, seed=seed)
                else:
                    loader = MixtureLoader({"large": rows, "small": other}, {"large": 0.7, "small": 0.3},
                                           global_batch_size=global_batch, seed=seed)
                if temperature == "warm":
                    _time_batches(loader, steps)  # the pages these batches read are now cached
                    loader = type(loader)(*((rows,) if kind == "BatchLoader" else
                                            ({"large": rows, "small": other}, {"large": 0.7, "small": 0.3})),
                                          global_batch_size=global_batch, seed=seed)
                seconds = _time_batches(loader, steps)
                row_tokens = rows.shape[1] - 1
                results.append({"loader": kind, "global_batch": global_batch, "page_cache": temperature,
                                "steps": steps, "tokens_per_s": steps * global_batch * row_tokens / seconds,
                                "ms_per_batch": 1000 * seconds / steps})
                del rows, other, loader
    return results


def _extract_baseline(revision: str, folder: Path) -> tuple[str, str]:
    """REV's data/ package as an importable `baseline_data` under `folder`; returns (package, path)."""
    target = folder / "baseline_data"
    if not target.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(_REPO), "archive", revision, "data"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        (folder / "data").rename(target)
    return "baseline_data", str(folder)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "spillway-data-bench")
    parser.add_argument("--bytes", type=float, default=250e6)
    parser.add_argument("--num-proc", default="1,2", help="comma-separated; 1: threads in one process")
    parser.add_argument("--baseline", default=None, help="a git revision whose data/ package to measure too")
    parser.add_argument("--loader-steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spillway.data import prepare_tokens, stream_documents, train_tokenizer

    work = args.workdir
    corpora = {"large": int(args.bytes), "small": int(args.bytes) // 8}
    report: dict = {"corpora": {}, "prepare": [], "loader": []}
    for name, size in corpora.items():
        folder = work / "corpus" / name
        if not folder.is_dir():  # written aside and renamed: an interrupted write is not taken for a corpus
            documents, written = write_corpus(folder.with_name(name + ".partial"), size)
            folder.with_name(name + ".partial").rename(folder)
        else:
            files = list(folder.rglob("*.txt"))
            documents, written = len(files), sum(path.stat().st_size for path in files)
        report["corpora"][name] = {"documents": documents, "bytes": written}
        print(f"corpus {name}: {documents} documents, {written / MB:.1f} MB", file=sys.stderr)

    start = time.perf_counter()
    tokenizer = train_tokenizer(stream_documents(str(work / "corpus" / "large")), vocab_size=4096,
                                cache_dir=work / "tokenizers")
    tokenizer_path = tokenizer.save(work / "tokenizer-4096.model")
    report["tokenizer_s"] = time.perf_counter() - start

    runs = [("spillway.data", "", int(n)) for n in args.num_proc.split(",")]
    if args.baseline:
        package, path = _extract_baseline(args.baseline, work / f"baseline-{args.baseline}")
        runs.append((package, path, 1))
    for package, path, num_proc in runs:
        for name in ("small", "large"):
            cache = work / "cache" / f"{package}-{num_proc}-{name}"
            subprocess.run(["rm", "-rf", str(cache)], check=True)
            result = measure_preparation(work / "corpus" / name, tokenizer_path, cache, num_proc=num_proc,
                                         package=package, path=path)
            result.update(corpus=name, package=package if package == "spillway.data" else f"data/ at {args.baseline}")
            report["prepare"].append(result)
            print(f"{result['package']:>24} num_proc={num_proc} {name:>5}: {result['tokens'] / 1e6:6.1f}M tokens "
                  f"{result['wall_s']:6.1f} s wall {result['tree_cpu_s']:6.1f} s cpu "
                  f"{result['tokens_per_cpu_s'] / 1e6:5.2f}M tok/s/core  peak RSS {result['self_peak_rss_mb']:6.0f} MB "
                  f"(with workers {result['tree_peak_rss_mb']:6.0f} MB)", file=sys.stderr)

    # The loader: rows of 8192 (+1) tokens, packed again from the token shards cached above.
    cache = work / "cache" / "spillway.data-1-large"
    start = time.perf_counter()
    long_rows = prepare_tokens(str(work / "corpus" / "large"), tokenizer, seq_len=8192, cache_dir=cache)
    other = prepare_tokens(str(work / "corpus" / "small"), tokenizer, seq_len=8192,
                           cache_dir=work / "cache" / "spillway.data-1-small")
    report["repack_8192_s"] = time.perf_counter() - start
    report["loader"] = measure_loaders(long_rows.path, other.path, steps=args.loader_steps)
    del long_rows, other
    for row in report["loader"]:
        print(f"{row['loader']:>13} batch {row['global_batch']} x 8193 {row['page_cache']}: "
              f"{row['tokens_per_s'] / 1e6:8.1f}M tokens/s ({row['ms_per_batch']:.2f} ms/batch)", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
