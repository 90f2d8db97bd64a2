"""Run deviceless GPU compiles in a child process set up for them.

PJRT plugins are discovered when JAX initialises its backends, and a process that
trains (or tests) on CPU has usually done that long before it wants to plan. So
compiles for a GPU target run in a child: ``python -m <module> <args>`` with the
plugin folder first on ``PYTHONPATH``, ``JAX_PLATFORMS=cpu`` (JAX runs on the CPU;
the plugin is only used as a compiler), ptxas on ``PATH``. The child prints one
JSON document on stdout; everything else it or XLA prints goes to stderr, which
the parent keeps and shows only when the child fails. ``JAX_PLATFORMS=cpu`` also
makes the plugin skip its CUDA library checks, whose "Unable to load cuDNN"
traceback would otherwise greet every start (and unregister the plugin); should
it appear anyway, it is cut from the stderr shown.

A child module looks like (importing JAX at the top is fine: backends start
later, after ``serve_compile_process`` has set the process up)::

    import jax
    from spillway.recipes.plan import compile as aot

    def main(argv: list[str]) -> dict:
        mesh = aot.compile_only_mesh("h200", {"data": 8})
        ...
        return {"report": aot.compile_report(jax.jit(step), *args).to_dict()}

    if __name__ == "__main__":
        serve_compile_process(main)

and the parent calls ``run_in_compile_process("my.module", ["--target", "h200"])``.
Nothing here imports JAX.

Compile processes never outlive their parent: each starts through
``parent_guard`` (the kernel kills it when the parent dies, however it dies:
SIGKILL included), and ``compile_processes_bounded`` kills the live ones when
the parent stops for any other reason (Ctrl-C, SIGTERM, an error), before its
threads are joined, so stopping a planner takes no longer than the signal.
A request goes to the child on stdin (``input_text``), so no file is left
behind on any exit path.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from spillway.recipes.plan import plugin

STDERR_TAIL_LINES = 40
# The plugin's report that CUDA runtime libraries (not needed to compile) are
# missing: a traceback from its first line to the "Is it installed?" line.
_NOISE_START = "Jax plugin configuration error"
_NOISE_END = "Is it installed?"


class CompileToolchainMissing(RuntimeError):
    """The plugin or the CUDA toolkit is missing; the message says how to install it."""


class CompileProcessError(RuntimeError):
    """The compile process failed; the message holds the command and its stderr tail."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr


def _package_root() -> Path:
    """The folder that holds the ``recipes`` package, so the child imports this copy."""
    return Path(__file__).resolve().parents[2]


def _prepend_path(existing: str | None, *entries: str) -> str:
    parts = [entry for entry in entries if entry]
    parts += [part for part in (existing or "").split(os.pathsep) if part and part not in parts]
    return os.pathsep.join(parts)


def _toolchain_env_updates(env: Mapping[str, str]) -> dict[str, str]:
    """PATH and XLA_FLAGS changes that let XLA find ptxas and libdevice where we found them."""
    updates = {}
    ptxas = plugin.find_ptxas()
    if ptxas is not None:
        updates["PATH"] = _prepend_path(env.get("PATH"), str(ptxas.parent))
    cuda_root = plugin.find_cuda_root()
    flags = env.get("XLA_FLAGS", "")
    if cuda_root is not None and cuda_root != Path("/usr/local/cuda") \
            and "--xla_gpu_cuda_data_dir" not in flags:
        updates["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={cuda_root}".strip()
    return updates


def compile_process_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a compile process, derived from ``base`` (default: ours)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _prepend_path(env.get("PYTHONPATH"), str(plugin.plugin_dir()),
                                      str(_package_root()))
    # JAX stays on the CPU; the cuda plugin is registered but only compiles.
    env["JAX_PLATFORMS"] = "cpu"
    env.update(_toolchain_env_updates(env))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # XLA's C++ warnings (e.g. "Can't reduce memory use below ... by rematerialization"
    # for every plan that does not fit) would bury the table; the table says it.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _useful_stderr_tail(stderr: str, lines: int = STDERR_TAIL_LINES) -> str:
    kept, in_noise = [], False
    for line in stderr.splitlines():
        if _NOISE_START in line:
            in_noise = True
        if not in_noise and line.strip():
            kept.append(line)
        if in_noise and _NOISE_END in line:
            in_noise = False
    return "\n".join(kept[-lines:])


_live: set[subprocess.Popen] = set()    # compile processes running now, from any thread
_live_guard = threading.Lock()


def stop_compile_processes() -> int:
    """Kills every compile process still running (they only compile: nothing is lost); returns how many."""
    with _live_guard:
        running = list(_live)
    for process in running:
        with contextlib.suppress(OSError):
            process.kill()
    return len(running)


@contextlib.contextmanager
def compile_processes_bounded():
    """While compile processes run: SIGTERM stops this process (SystemExit 143, in the main thread, where
    it was left at its default), and any exit by exception kills the live compile processes at once.

    Use it inside a thread pool's `with` (so it exits first): the pool's threads then return as soon as
    their processes are killed, instead of waiting for them to finish compiling."""
    previous = None
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def terminate(signum, frame):
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except BaseException:
        stop_compile_processes()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exchange(process: subprocess.Popen, input_text: str | None, timeout_s: float | None,
              on_progress: Callable[[Any], None] | None) -> tuple[str, str, bool]:
    """(stdout, stderr without the progress lines, whether it was killed for the timeout) of `process`, fed
    `input_text`. Its stderr is read as it comes: each `report_progress` line goes to `on_progress` at once
    (from a reader thread), the rest is kept for the error message."""
    kept: list[str] = []

    def read_stderr():
        for line in process.stderr:
            if line.startswith(PROGRESS_PREFIX) and on_progress is not None:
                try:
                    on_progress(json.loads(line[len(PROGRESS_PREFIX):]))
                    continue
                except ValueError:
                    pass   # a line cut short (the child died while writing it): keep it as text
            if not line.startswith(PROGRESS_PREFIX):
                kept.append(line)

    def feed_stdin():
        if process.stdin is None:
            return
        with contextlib.suppress(OSError):   # a child that died before reading: its exit says why
            if input_text is not None:
                process.stdin.write(input_text)
            process.stdin.close()

    killed = threading.Event()

    def kill_for_timeout():
        killed.set()
        process.kill()

    helpers = [threading.Thread(target=read_stderr, daemon=True), threading.Thread(target=feed_stdin, daemon=True)]
    for helper in helpers:
        helper.start()
    timer = threading.Timer(timeout_s, kill_for_timeout) if timeout_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        stdout = process.stdout.read()
        process.wait()
    finally:
        if timer is not None:
            timer.cancel()
    for helper in helpers:
        helper.join()
    return stdout, "".join(kept), killed.is_set()


# A compile process's line on stderr that carries a JSON value for the parent's `on_progress` (one per finished
# compile in recipes/plan/child.py), so the parent can say what finished while the rest still compiles.
PROGRESS_PREFIX = "spillway-compile-progress: "


def report_progress(value: Any) -> None:
    """In a compile process: send `value` (JSON-ready) to the parent's `on_progress` now, as one line."""
    sys.stderr.write(PROGRESS_PREFIX + json.dumps(value) + "\n")
    sys.stderr.flush()


def run_in_compile_process(module: str, args: Sequence[str] = (), *,
                           timeout_s: float | None = 900,
                           env: Mapping[str, str] | None = None, input_text: str | None = None,
                           on_progress: Callable[[Any], None] | None = None) -> Any:
    """Run ``python -m module *args`` as a compile process; return the JSON it prints.

    `input_text` goes to its stdin; `on_progress` gets each value the child sends with `report_progress`,
    while it runs. Raises CompileToolchainMissing before starting when the plugin or CUDA
    toolkit is missing, and CompileProcessError when the child fails, times out or prints something other
    than one JSON document. The child dies with this process (module docstring).
    """
    reason = plugin.missing_reason()
    if reason is not None:
        raise CompileToolchainMissing(f"deviceless GPU compiles need:\n{reason}")
    from spillway.recipes.plan.parent_guard import PARENT_PID_ENV

    command = [sys.executable, "-m", module, *map(str, args)]
    child_env = {**compile_process_env(env), PARENT_PID_ENV: str(os.getpid())}
    process = subprocess.Popen([sys.executable, "-m", "spillway.recipes.plan.parent_guard", *command[2:]],
                               stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env)
    with _live_guard:
        _live.add(process)
    try:
        stdout, stderr, timed_out = _exchange(process, input_text, timeout_s, on_progress)
    except BaseException:
        process.kill()   # this thread was interrupted: the child must not outlive the wait for it
        process.wait()
        raise
    finally:
        with _live_guard:
            _live.discard(process)
    if timed_out:
        raise CompileProcessError(
            f"compile process `python {' '.join(command[1:])}` did not finish in {timeout_s} s; "
            f"last stderr lines:\n{_useful_stderr_tail(stderr)}", stderr)
    completed = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if completed.returncode != 0:
        raise CompileProcessError(
            f"compile process `python {' '.join(command[1:])}` failed with exit code "
            f"{completed.returncode}; last stderr lines:\n{_useful_stderr_tail(completed.stderr)}",
            completed.stderr)
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError as error:
        raise CompileProcessError(
            f"compile process `python {' '.join(command[1:])}` printed no single JSON document on "
            f"stdout ({error}); stdout began {completed.stdout[:300]!r}; last stderr lines:\n"
            f"{_useful_stderr_tail(completed.stderr)}", completed.stderr) from None


def prepare_compile_process() -> None:
    """Make this process able to compile for GPUs: call before JAX initialises backends.

    Puts the plugin folder on sys.path, sets JAX_PLATFORMS=cpu and the toolchain
    environment. Works after ``import jax`` as long as no backend was initialised
    yet (plugins are discovered at backend start); after that it raises, unless
    the plugin is already loaded.
    """
    jax_imported = "jax" in sys.modules
    if jax_imported:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            # No public way to ask which plugins registered.
            if "cuda" in xla_bridge._backend_factories:   # noqa: SLF001
                return
            raise RuntimeError(
                "JAX initialised its backends before the GPU compiler plugin was on "
                "sys.path; compile in a fresh process (run_in_compile_process)")
    directory = str(plugin.plugin_dir())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.update(_toolchain_env_updates(os.environ))
    if jax_imported:
        import jax
        jax.config.update("jax_platforms", "cpu")


def served_or_measured(args, parse_args: Callable[[list[str]], Any], measure: Callable[[Any], Any]) -> Any:
    """A compile benchmark's figures: with `args.json` this process serves them as a compile process (parsing
    its own argv, printing the JSON, exiting); else measured here, the process first made able to compile."""
    if args.json:
        serve_compile_process(lambda argv: measure(parse_args(argv)))
    prepare_compile_process()
    return measure(args)


def serve_compile_process(main: Callable[[list[str]], Any]) -> NoReturn:
    """Entry point of a compile-process module: set up, run ``main(argv)``, print its JSON.

    File descriptor 1 is pointed at stderr while ``main`` runs, so that stray
    prints from Python or from XLA's C++ cannot corrupt the JSON document, which
    goes to the original stdout at the end.
    """
    json_stdout = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        prepare_compile_process()
        result = main(sys.argv[1:])
        text = json.dumps(result)
    except SystemExit:
        raise
    except BaseException:   # report every failure, including KeyboardInterrupt, on stderr
        traceback.print_exc()
        sys.exit(1)
    json_stdout.write(text + "\n")
    json_stdout.flush()
    sys.exit(0)
