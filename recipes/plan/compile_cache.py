"""The planner's on-disk cache of deviceless compiles: a repeated plan of the same recipe and GPU compiles nothing.

Two kinds of entry, one small JSON file each, under the user's cache folder
(`$SPILLWAY_CACHE_DIR`, else `$XDG_CACHE_HOME/spillway`, else `~/.cache/spillway`; `plan/` inside it).
`SPILLWAY_PLAN_CACHE=0` (or `spillway plan --no-cache`) turns it off.

- `programs/`: what XLA's compile of one lowered train step gave (the CompileReport figures the planner
  reads, never code or HLO), keyed by `program_key`: the lowered StableHLO text with its source positions
  cut (file:line:column moves with every edit; op names, which the pass split of the host traffic reads,
  stay), the XLA options, the toolchain (`toolchain_fingerprint`: jax, jaxlib, flax, the GPU plugin's
  version, XLA_FLAGS and the JAX_ settings, and the source of the code that reads a compiled program into
  figures, `ANALYSIS_MODULES`), the target's GpuTargetConfigProto and the GPU count. The
  compile process (recipes/plan/child.py) writes and reads these: a setting that leaves a program as it was
  (train.steps, the learning rate, a comment in a layer) lowers again and compiles nothing.
- `requests/`: what the planner asked for, keyed by `request_key`: the recipe with the candidate applied, the
  target, the GPU count, the XLA options, the toolchain and a digest of spillway's own source (and of the
  recipe's block module), pointing at its program and holding its bounds (recipes/plan/child.py
  `candidate_bounds`: the device-resident arguments, the host phases without the step). The planner
  (recipes/plan/planner.py) reads these first: a plan whose every candidate hits starts no compile process
  at all. Any code change misses here and falls back on the program key.

An entry that cannot be read, is not JSON, or lacks a figure is ignored with a warning (and written again
after the compile); a cache folder that cannot be written only costs the cache. Entries are written to a
temporary file and renamed, so a stopped plan leaves none half written.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "SPILLWAY_CACHE_DIR"
CACHE_SWITCH_ENV = "SPILLWAY_PLAN_CACHE"
FORMAT = 1
# What a programs/ entry must hold: the CompileReport fields the planner reads (recipes/plan/cost_model.py,
# result.py, chart.py, host_peak.py).
REPORT_FIELDS = ("hbm_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "host_bytes",
                 "host_argument_bytes", "host_output_bytes", "host_alias_bytes", "host_temp_bytes",
                 "host_buffer_count", "device_to_host_bytes", "host_to_device_bytes", "overlapped_transfer_bytes",
                 "overlapped_bytes_by_pass", "transfer_bytes_by_pass", "async_copy_bytes_by_pass",
                 "copies_beside_compute_by_pass", "conditional_host_to_device_bytes",
                 "host_kernel_copy_bytes")
_PACKAGES = ("spillway.layers", "spillway.models", "spillway.recipes", "spillway.data")
# The code that reads a compiled program into the report's figures: a change to it changes the figures of a
# program that did not change, so its source is part of every key (the toolchain fingerprint).
ANALYSIS_MODULES = ("spillway.recipes.plan.hlo", "spillway.recipes.plan.compile")


def enabled(environ=os.environ) -> bool:
    return environ.get(CACHE_SWITCH_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def cache_dir(environ=os.environ) -> Path:
    """The plan cache's folder (not created here)."""
    root = environ.get(CACHE_DIR_ENV) or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spillway")
    return Path(root) / "plan"


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def toolchain_fingerprint(environ=os.environ) -> dict:
    """What besides the program decides a compile's figures: library versions and XLA/JAX settings."""
    from spillway.recipes.plan import plugin

    versions = {}
    for name in ("jax", "jaxlib", "flax", "numpy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    # JAX's own compilation cache settings say where executables are kept, not what they are.
    settings = {k: v for k, v in environ.items()
                if (k.startswith("JAX_") or k.startswith("XLA_")) and k != "JAX_PLATFORMS"
                and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return {"python": sys.version.split()[0], "versions": versions, "gpu_plugin": plugin.installed_version(),
            "settings": settings, "analysis": source_digest(ANALYSIS_MODULES, packages=())}


def source_digest(extra_modules: tuple[str, ...] = (), packages: tuple[str, ...] = _PACKAGES) -> str:
    """sha256 of spillway's Python source (`packages`: layers, models, recipes, data) and of `extra_modules` (a
    recipe's own block module), by path and content."""
    files: list[Path] = []
    for name in (*packages, *extra_modules):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                files += sorted(Path(folder).rglob("*.py"))
        elif spec.origin:
            files.append(Path(spec.origin))
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{len(path.parts)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def request_key(recipe_dict: dict, target_config: str, devices: int, compiler_options: dict | None,
                fingerprint: dict, source: str) -> str:
    return _digest({"format": FORMAT, "recipe": recipe_dict, "target": target_config, "devices": devices,
                    "options": compiler_options, "toolchain": fingerprint, "source": source})


# A source position in MLIR's text: loc("file.py":12:3), loc("file.py":12:3 to 14:5), loc("file.py":4:6 to :68).
_FILE_LOCATION = re.compile(r'"[^"\n]*":\d+:\d+(?: to \d*:?\d+)?')


def program_text(lowered_text_with_locations: str) -> str:
    """The lowered program as the cache keys it: source positions cut, op names kept."""
    return _FILE_LOCATION.sub('"?"', lowered_text_with_locations)


def program_key(program: str, target_config: str, devices: int, compiler_options: dict | None,
                fingerprint: dict) -> str:
    return _digest({"format": FORMAT, "program": hashlib.sha256(program.encode()).hexdigest(),
                    "target": target_config, "devices": devices, "options": compiler_options,
                    "toolchain": fingerprint})


class CompileCache:
    """Reads and writes entries under `directory`; `warnings` collects one line per damaged entry ignored."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.warnings: list[str] = []

    def _path(self, kind: str, key: str) -> Path:
        return self.directory / kind / key[:2] / f"{key}.json"

    def get(self, kind: str, key: str, required: tuple[str, ...] = ()) -> dict | None:
        """The entry's value, or None (absent, or damaged: then a warning)."""
        path = self._path(kind, key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.warnings.append(f"compile cache: cannot read {path} ({error.strerror or error}); compiling again")
            return None
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
                raise ValueError("not an entry of this format and key")
            value = entry["value"]
            missing = [name for name in required if name not in value]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
        except (ValueError, KeyError, TypeError) as error:
            self.warnings.append(f"compile cache: ignoring the damaged entry {path} ({str(error)[:120]}); "
                                 f"compiling again")
            return None
        return value

    def put(self, kind: str, key: str, value: dict) -> None:
        path = self._path(kind, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", suffix=".json",
                                             delete=False) as f:
                json.dump({"format": FORMAT, "key": key, "value": value}, f)
            os.replace(f.name, path)
        except OSError as error:
            warning = f"compile cache: cannot write {path.parent} ({error.strerror or error}); not cached"
            if warning not in self.warnings:
                self.warnings.append(warning)


def report_figures(report: dict) -> dict:
    """What a programs/ entry keeps of a compile report: its figures (the HLO text never)."""
    return {k: v for k, v in report.items() if k not in ("hlo_text", "host_phases")}
