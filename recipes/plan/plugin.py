"""Where the GPU compiler plugin lives, whether it matches this JAX, and how to install it.

Compiling a train step for a GPU on a machine without one needs two things that
a CPU-only JAX install lacks (docs/DESIGN.md section 5):

* the jax-cuda13 PJRT plugin (``jax-cuda13-plugin`` + ``jax-cuda13-pjrt``, about
  400 MB unpacked) at exactly jaxlib's version. We install it with ``--no-deps``
  (the nvidia-* runtime wheels are multi-GB and not needed to compile) into a
  folder of its own, not into site-packages: imported into an ordinary JAX process
  on a machine without a GPU the plugin prints a cuDNN traceback at every start.
  Only the compile process (``spillway.recipes.plan.subprocess_runner``) puts the folder on
  ``sys.path``.
* ``ptxas`` and ``libdevice`` from a CUDA toolkit: XLA compiles PTX to SASS by
  running ptxas (this plugin build has no built-in PTX compiler).

Run ``python -m spillway.recipes.plan.plugin install`` (what the Makefile does) to install
or update the plugin, ``python -m spillway.recipes.plan.plugin status`` to see what is
missing. Nothing here imports JAX.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN_DIR_ENV = "SPILLWAY_GPU_PLUGIN_DIR"
PLUGIN_FOLDER_NAME = "spillway-gpu-plugin"
PLUGIN_DISTRIBUTIONS = ("jax-cuda13-plugin", "jax-cuda13-pjrt")
# The plugin wheels are built for these platforms only.
PLUGIN_PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64")}


class PluginInstallError(RuntimeError):
    """pip could not install the plugin; the message says why and what to do."""


def _package_root() -> Path:
    """The folder holding the ``recipes`` package: the repo root in a checkout."""
    return Path(__file__).resolve().parents[2]


def _is_source_checkout(root: Path) -> bool:
    # A non-editable install puts `recipes` straight into site-packages, where
    # no pyproject.toml sits beside it.
    return (root / "pyproject.toml").is_file() and (root / "recipes" / "plan").is_dir()


def plugin_dir() -> Path:
    """The folder the plugin is (to be) installed in.

    ``$SPILLWAY_GPU_PLUGIN_DIR`` if set; else, in a virtual environment,
    ``<sys.prefix>/spillway-gpu-plugin``: the folder sits inside the environment
    whose jaxlib it matches, so the test environments of the Makefile (``.venv``,
    ``.venv-jax011``, ``.venv-newest``: one checkout, three jaxlib versions) each
    have their own. Outside a virtual environment: ``<repo>/.venv/spillway-gpu-plugin``
    in a source checkout, else ``<sys.prefix>/spillway-gpu-plugin``.
    """
    override = os.environ.get(PLUGIN_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / PLUGIN_FOLDER_NAME
    root = _package_root()
    if _is_source_checkout(root):
        return root / ".venv" / PLUGIN_FOLDER_NAME
    return Path(sys.prefix) / PLUGIN_FOLDER_NAME


def required_version() -> str:
    """jaxlib's version: the plugin must be built for exactly this one."""
    return importlib.metadata.version("jaxlib")


def _installed_distributions(directory: Path) -> dict[str, importlib.metadata.Distribution]:
    if not directory.is_dir():
        return {}
    found = {}
    for dist in importlib.metadata.distributions(path=[str(directory)]):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in PLUGIN_DISTRIBUTIONS:
            found[name] = dist
    return found


def installed_versions(directory: Path | None = None) -> dict[str, str]:
    """Version of each plugin distribution found in the plugin folder."""
    dists = _installed_distributions(directory or plugin_dir())
    return {name: dist.version for name, dist in dists.items()}


def installed_version(directory: Path | None = None) -> str | None:
    """The plugin's version if both of its distributions are there at one version, else None."""
    versions = installed_versions(directory)
    if set(versions) != set(PLUGIN_DISTRIBUTIONS) or len(set(versions.values())) != 1:
        return None
    return next(iter(versions.values()))


def _python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _plugin_python_tags(directory: Path) -> set[str]:
    """Python tags of the plugin wheel (it holds CPython extensions, so it is per-version)."""
    dist = _installed_distributions(directory).get("jax-cuda13-plugin")
    if dist is None:
        return set()
    wheel_text = dist.read_text("WHEEL") or ""
    tags = set()
    for line in wheel_text.splitlines():
        if line.startswith("Tag:"):
            tags.add(line.split(":", 1)[1].strip().split("-")[0])
    return tags


def install_command(directory: Path | None = None, version: str | None = None) -> list[str]:
    """The exact pip command that installs the plugin matching this jaxlib."""
    version = version or required_version()
    return [
        sys.executable, "-m", "pip", "install", "--no-deps",
        "--target", str(directory or plugin_dir()),
        *(f"{name}=={version}" for name in PLUGIN_DISTRIBUTIONS),
    ]


def install_command_text(directory: Path | None = None) -> str:
    """install_command() as one shell line, for messages."""
    return shlex.join(install_command(directory))


def _no_matching_release_message(version: str, pip_output: str) -> str:
    return (
        f"pip found no jax-cuda13-plugin / jax-cuda13-pjrt release at version {version} "
        f"(the version of the installed jaxlib). The plugin is released together with "
        f"jaxlib, but not always at every jaxlib version, and only for Linux x86_64 and "
        f"aarch64. Either install a jax/jaxlib version that has a plugin release "
        f"(`pip index versions jax-cuda13-plugin` lists them), or install a matching "
        f"plugin yourself into a folder and point ${PLUGIN_DIR_ENV} at it.\n"
        f"pip said:\n{pip_output.strip()[-2000:]}"
    )


def _holds_only_the_plugin(directory: Path) -> bool:
    """Whether every entry of ``directory`` is something pip put there for the plugin."""
    return all(entry.name.startswith(("jax_plugins", "jax_cuda13", "__pycache__"))
               for entry in directory.iterdir())


def install(force: bool = False, directory: Path | None = None) -> bool:
    """Install the plugin matching jaxlib; return False if it was already there.

    Idempotent: skips when the installed version equals jaxlib's, replaces it when
    it differs. pip installs into a fresh sibling folder that then replaces the old
    one, so a failed install (no network, no such version) leaves the old plugin
    in place (and ``pip --target`` into an existing folder only warns and keeps the
    old package).
    """
    directory = directory or plugin_dir()
    version = required_version()
    current = installed_version(directory)
    tags = _plugin_python_tags(directory)
    python_ok = not tags or _python_tag() in tags
    if current == version and python_ok and not force:
        return False
    if directory.is_dir() and not _holds_only_the_plugin(directory):
        # The old folder is deleted after the swap; never do that to someone's files.
        raise PluginInstallError(
            f"refusing to install the GPU compiler plugin into {directory}: it holds files "
            f"that are not the plugin's. Point ${PLUGIN_DIR_ENV} at an empty or new folder.")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-new-", dir=directory.parent))
    try:
        command = install_command(staging, version)
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            output = completed.stdout + completed.stderr
            if "No matching distribution" in output or "Could not find a version" in output:
                raise PluginInstallError(_no_matching_release_message(version, output))
            raise PluginInstallError(
                f"installing the GPU compiler plugin failed (exit {completed.returncode}):\n"
                f"  {shlex.join(command)}\n{output.strip()[-3000:]}")
        retired = None
        if directory.exists():
            retired = directory.with_name(f".{directory.name}-old-{os.getpid()}")
            directory.rename(retired)
        staging.rename(directory)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return True


def _cuda_roots() -> list[Path]:
    """CUDA toolkit folders to look in, most specific first."""
    roots = [Path(os.environ[var]) for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_DIR")
             if os.environ.get(var)]
    roots.append(Path("/usr/local/cuda"))
    # Newest versioned toolkit first: /usr/local/cuda-13.0 before /usr/local/cuda-12.8.
    def version_key(path: str) -> tuple[int, ...]:
        suffix = path.rsplit("cuda-", 1)[-1]
        return tuple(int(part) for part in suffix.split(".") if part.isdigit())
    roots.extend(Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), key=version_key, reverse=True))
    return roots


def find_ptxas() -> Path | None:
    """ptxas on PATH, else in a CUDA toolkit under $CUDA_HOME or /usr/local/cuda*."""
    on_path = shutil.which("ptxas")
    if on_path:
        return Path(on_path)
    for root in _cuda_roots():
        candidate = root / "bin" / "ptxas"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_cuda_root() -> Path | None:
    """A CUDA toolkit folder holding libdevice (``nvvm/libdevice/libdevice.10.bc``).

    XLA links libdevice into every kernel that calls a math function; it finds it
    under its default CUDA folders, or under ``--xla_gpu_cuda_data_dir``, which
    the compile process sets from this when the toolkit is somewhere unusual.
    """
    candidates = _cuda_roots()
    ptxas = find_ptxas()
    if ptxas is not None:
        # ptxas may be a wrapper script (/usr/local/bin/ptxas); its real toolkit
        # is then unknown, so it only adds a candidate.
        candidates.insert(0, ptxas.resolve().parent.parent)
    for root in candidates:
        if (root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file():
            return root
    return None


def cuda_toolkit_missing_reason() -> str | None:
    """What of the CUDA toolkit (ptxas, libdevice) is missing, or None."""
    problems = []
    if find_ptxas() is None:
        problems.append("ptxas (CUDA toolkit) was not found on PATH, in $CUDA_HOME/bin or in "
                        "/usr/local/cuda*/bin")
    if find_cuda_root() is None:
        problems.append("libdevice (nvvm/libdevice/libdevice.10.bc from a CUDA toolkit) was not "
                        "found under $CUDA_HOME or /usr/local/cuda*")
    if not problems:
        return None
    return ("; ".join(problems) + ". Install the CUDA 13 toolkit's compiler (e.g. the "
            "cuda-nvcc-13-0 package from NVIDIA's apt repository, or `pip install "
            "nvidia-cuda-nvcc` and set CUDA_HOME to its folder).")


def plugin_missing_reason() -> str | None:
    """What is wrong with the plugin folder (missing, other version, other Python), or None."""
    if (sys.platform, os.uname().machine) not in PLUGIN_PLATFORMS:
        return (f"the jax-cuda13 plugin is only released for Linux x86_64/aarch64, not "
                f"{sys.platform}/{os.uname().machine}: compile for GPUs on a Linux machine")
    directory = plugin_dir()
    versions = installed_versions(directory)
    wanted = required_version()
    # This interpreter's own command: `make gpu-plugin` installs into .venv only, the wrong fix in .venv-jax011,
    # .venv-newest or a pip-installed spillway.
    fix = (f"install it with `{shlex.quote(sys.executable)} -m spillway.recipes.plan.plugin install`, which runs "
           f"`{install_command_text(directory)}`")
    if not versions:
        return f"the GPU compiler plugin is not installed in {directory}: {fix}"
    if set(versions) != set(PLUGIN_DISTRIBUTIONS):
        missing = sorted(set(PLUGIN_DISTRIBUTIONS) - set(versions))
        return f"the GPU compiler plugin in {directory} lacks {', '.join(missing)}: {fix}"
    if any(version != wanted for version in versions.values()):
        found = ", ".join(f"{name}=={version}" for name, version in sorted(versions.items()))
        return (f"the GPU compiler plugin in {directory} ({found}) does not match jaxlib "
                f"{wanted}: {fix}")
    tags = _plugin_python_tags(directory)
    if tags and _python_tag() not in tags:
        return (f"the GPU compiler plugin in {directory} was built for {', '.join(sorted(tags))}, "
                f"not this Python ({_python_tag()}): reinstall it with "
                f"`python -m spillway.recipes.plan.plugin install --force`")
    return None


def missing_reason() -> str | None:
    """Everything a deviceless GPU compile still needs, with how to get it; None if ready."""
    reasons = [reason for reason in (plugin_missing_reason(), cuda_toolkit_missing_reason())
               if reason]
    return "; and ".join(reasons) or None


def _main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "install":
        try:
            installed = install(force="--force" in argv[1:])
        except PluginInstallError as error:
            print(error, file=sys.stderr)
            return 1
        state = "installed" if installed else "already installed"
        print(f"GPU compiler plugin {required_version()} {state} in {plugin_dir()}")
        return 0
    if command == "status":
        print(f"plugin folder: {plugin_dir()}")
        print(f"jaxlib: {required_version()}; plugin: {installed_versions() or 'not installed'}")
        print(f"ptxas: {find_ptxas() or 'not found'}; CUDA toolkit: {find_cuda_root() or 'not found'}")
        reason = missing_reason()
        print("ready for deviceless GPU compiles" if reason is None else f"missing:\n{reason}")
        return 0 if reason is None else 1
    if command == "command":
        print(install_command_text())
        return 0
    print("usage: python -m spillway.recipes.plan.plugin [status | install [--force] | command]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
