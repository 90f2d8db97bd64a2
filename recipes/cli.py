"""The `spillway` command: list recipes, train, sample from a checkpoint, plan memory for a GPU.

    spillway recipes [NAME]
    spillway train tiny [--set train.steps=100 ...] [--plan auto [--gpu h200]]
    spillway train path/to/recipe.json | my_recipes:my_recipe [--set ...]   (recipes/user_recipes.py)
    spillway prepare tiny [--set ...]   (the run's tokenizer and rows into the cache, before the run)
    spillway generate runs/tiny --prompt "def " [--tokens 100 --temperature 0.8 --top-p 0.95]
    spillway generate runs/tiny_sft --chat "Write a function that adds a and b."
    spillway export runs/sft out/ [--adapter]   (a Hugging Face folder; --adapter: a PEFT LoRA adapter)
    spillway plan llama3_8b [--gpu h200] [--devices N] [--hbm-budget GIB] [--png PATH] [--json]

`--gpu` and `--devices` default to the GPUs the recipe was planned for
(offload.target_gpu, offload.target_devices), else one H200.

Errors are one line on stderr and a non-zero exit status: 2 for a failure
the user can fix (a SpillwayError, e.g. a bad setting, a checkpoint that does
not match, a loss that went NaN; a bad argument; a file the OS refused), 1 for
anything else, which is a bug in spillway and says so. `--debug` (or
SPILLWAY_DEBUG=1) shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import textwrap

from spillway.layers.errors import ConfigError, SpillwayError
from spillway.recipes.ctrl_c import Terminated, interrupts_until_caught
from spillway.recipes.targets import DEFAULT_GPU, HBM_HEADROOM

DEBUG_ENV = "SPILLWAY_DEBUG"
EXIT_USER_ERROR = 2      # what argparse uses for a bad command line, too
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports it
EXIT_TERMINATED = 143    # 128 + SIGTERM
EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE: what a shell reports for a command whose reader left
_MAX_INTERNAL_MESSAGE = 500


def _cmd_recipes(args) -> int:
    from spillway.recipes.registry import get_recipe, recipe_names
    from spillway.recipes.user_recipes import load_recipe
    if args.json and not args.name:
        raise ConfigError("spillway recipes --json prints one recipe: give its NAME (spillway recipes tiny --json)")
    if args.set and not args.name:   # the list shows every recipe as registered: a --set would be dropped unsaid
        raise ConfigError("spillway recipes --set changes one recipe: give its NAME (spillway recipes tiny "
                          "--set train.steps=5)")
    if args.name:
        # one recipe in full: what it is, what its fields make of a step, where its numbers come from, then
        # every field (what `--set` can change); the parameter count is computed, never written into a
        # description, so it cannot go stale
        recipe = load_recipe(args.name, args.set)
        if args.json:   # a file `spillway train FILE` reads
            print(recipe.to_json())
            return 0
        print(textwrap.fill(f"{recipe.name} ({recipe.num_params() / 1e6:,.2f}M parameters): {recipe.description}",
                            width=100, subsequent_indent="  "))
        print(textwrap.fill(f"  {recipe.step_summary()}", width=100, subsequent_indent="  "))
        if recipe.sources:
            print(textwrap.fill(f"  Sources: {recipe.sources}", width=100, subsequent_indent="  "))
        print(recipe.to_json())
        return 0
    for name in recipe_names():
        recipe = get_recipe(name)
        print(f"{name:20s} {recipe.family:8s} {recipe.num_params() / 1e6:9.1f}M  {recipe.description}")
    return 0


def _refuse_empty_gpu(gpu: str | None) -> None:
    if gpu is not None and not gpu.strip():   # '' from an unset shell variable quietly meant the default
        from spillway.recipes.targets import TARGETS
        raise ConfigError(f"--gpu is empty: name a GPU ({', '.join(TARGETS)})")


def _cmd_train(args) -> int:
    for flag, value in (("--devices", args.devices), ("--stop-after", args.stop_after)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    _refuse_empty_gpu(args.gpu)
    given = [flag for flag, value in (("--gpu", args.gpu), ("--devices", args.devices)) if value is not None]
    if given and not args.plan:   # they only steer the plan: without it they were quietly ignored
        raise ConfigError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} read by --plan auto "
                          f"only: add --plan auto, or set the run's own mesh and offload with --set")
    from spillway.recipes.user_recipes import load_recipe
    recipe = load_recipe(args.recipe, args.set)   # a registered name, a recipe.json, or module:function
    if args.plan:
        from spillway.recipes.plan.commands import apply_plan
        from spillway.recipes.train.preflight import check_run_inputs
        check_run_inputs(recipe)   # a missing corpus or tokenizer fails now, not after minutes of compiles
        recipe = apply_plan(recipe, args.plan, gpu=args.gpu or recipe.offload.target_gpu or DEFAULT_GPU,
                            devices=args.devices, host_ram_gb=args.host_ram_gb)
    from spillway.recipes.train.loop import train
    train(recipe, stop_after=args.stop_after, host_ram_gb=args.host_ram_gb)
    return 0


def _cmd_prepare(args) -> int:
    from spillway.recipes.train.prepare_ahead import prepare_ahead
    from spillway.recipes.user_recipes import load_recipe
    prepare_ahead(load_recipe(args.recipe, args.set))
    return 0


def _refuse_empty_paths(**paths: str) -> None:
    """An empty path argument ('' from an unset shell variable) would mean the current directory: name it instead
    (an export into '' wrote its files into the working directory)."""
    for name, value in paths.items():
        if not value.strip():
            raise ConfigError(f"{name} is empty: give a path")


# Past this the logits over the temperature are all about zero in float32: every token as likely as any other.
MAX_TEMPERATURE = 1e6


def _refuse_undecodable(name: str, text: str | None) -> None:
    """A command-line text whose bytes were not UTF-8 (Python keeps them as lone surrogates, which the tokenizer
    cannot take: an internal error before) is one line."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ConfigError(f"{name} holds bytes that are not UTF-8 (at character {error.start + 1}): give the text in "
                          f"UTF-8 (for a cp1252/Latin-1 file: iconv -f cp1252 -t utf-8)") from None


def _cmd_generate(args) -> int:
    _refuse_empty_paths(CHECKPOINT=args.checkpoint)
    if args.tokens <= 0:
        raise ConfigError(f"--tokens must be positive, got {args.tokens}")
    from spillway.recipes.config import MAX_SEED   # here: it imports jax, and `spillway --help` should not
    if not 0 <= args.seed <= MAX_SEED:   # JAX keeps a seed's low 32 bits: larger ones repeat smaller ones
        raise ConfigError(f"--seed must be in [0, {MAX_SEED}] (JAX keeps a seed's low 32 bits), got {args.seed}")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be zero (greedy) or positive, got {args.temperature}")
    if not args.temperature <= MAX_TEMPERATURE:   # inf, or past float32 (1e300 became inf): uniform draws, unsaid
        raise ConfigError(f"--temperature must be finite and at most {MAX_TEMPERATURE:g} (larger samples every token "
                          f"alike), got {args.temperature}")
    for name, text in (("--prompt", args.prompt), ("--chat", args.chat)):
        _refuse_undecodable(name, text)
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    from spillway.recipes.generate import generate_from_checkpoint
    if (args.prompt is None) == (args.chat is None):
        raise ConfigError("spillway generate takes --prompt TEXT (continue a text) or --chat MESSAGE (answer it "
                          "through the run's chat template), one of them")
    text = generate_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                                    temperature=args.temperature, top_p=args.top_p, seed=args.seed, chat=args.chat)
    print(text)
    return 0


def _cmd_export(args) -> int:
    _refuse_empty_paths(CHECKPOINT=args.checkpoint, OUT_DIR=args.out_dir)
    from spillway.recipes.export import export_run
    if args.dtype is not None and args.adapter:
        raise ConfigError("--dtype casts the merged weights; the --adapter folder keeps the adapters' float32")
    export_run(args.checkpoint, args.out_dir, adapter=args.adapter, dtype=args.dtype)
    return 0


def _cmd_plan(args) -> int:
    from spillway.recipes.plan.commands import plan_command
    _refuse_empty_gpu(args.gpu)
    if args.gpu is None or args.devices is None:
        # the recipe's own target (offload.target_gpu x offload.target_devices), where it names one
        from spillway.recipes.user_recipes import load_recipe
        offload = load_recipe(args.recipe, args.set).offload
        args.gpu = args.gpu or offload.target_gpu or DEFAULT_GPU
        args.devices = offload.target_devices if args.devices is None else args.devices
    return plan_command(args)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other error of the command."""

    def error(self, message):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _amount_in(unit: str):
    """An argparse type: a plain number of `unit`. '80GB' is refused naming the unit the flag already means
    (argparse's own "invalid float value" left the user guessing whether a unit may be written)."""
    def amount(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: write the amount in {unit} without a "
                                             f"unit (e.g. 80)") from None
    return amount


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spillway", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("recipes", help="list the registered recipes, or show one in full", parents=[common])
    p.add_argument("name", nargs="?", help="a recipe: its description (with its sources) and all its fields")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field")
    p.add_argument("--json", action="store_true",
                   help="print the recipe's JSON alone (with NAME): a file to edit and give to `spillway train`")
    p.set_defaults(fn=_cmd_recipes)

    p = sub.add_parser("train", help="train a recipe", parents=[common])
    p.add_argument("recipe", help="a registered name, a recipe .json file, or module:function returning a Recipe")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field")
    p.add_argument("--plan", choices=["auto"], help="pick the offload plan with `spillway plan` first")
    p.add_argument("--gpu", default=None,
                   help=f"target GPU for --plan auto (default: the recipe's offload.target_gpu, else {DEFAULT_GPU})")
    p.add_argument("--devices", type=int, default=None, help="GPUs for --plan auto (default: the mesh's)")
    p.add_argument("--host-ram-gb", type=_amount_in("GB"), default=None,
                   help="host RAM to check the run's host memory peak against, in GB (10^9 bytes; "
                        "the plan shows GiB) (default: this machine's)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="save and leave after N steps of this invocation (time-limited jobs); rerun to resume")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("prepare", parents=[common],
                       help="tokenize a recipe's data into the cache its run reads (format, mixture, tokenizer, "
                            "chat template as the run has them), without a model or a run folder")
    p.add_argument("recipe", help="a registered name, a recipe .json file, or module:function returning a Recipe")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field")
    p.set_defaults(fn=_cmd_prepare)

    p = sub.add_parser("generate", help="sample text from a checkpoint", parents=[common])
    p.add_argument("checkpoint", help="a run directory or its checkpoints/ directory (the newest step), or a "
                                      "step folder")
    p.add_argument("--prompt", help="a text to continue")
    p.add_argument("--chat", metavar="MESSAGE",
                   help="a user message: rendered through the run's chat template, answered until the end of turn")
    p.add_argument("--tokens", type=int, default=100, help="new tokens to generate (> 0; default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0: greedy (the tokens transformers' generate() gives on the export); > 0: sampling "
                        "(default %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1] (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default %(default)s)")
    p.set_defaults(fn=_cmd_generate)

    p = sub.add_parser("export", help="write a run as a Hugging Face folder (LoRA merged), or its PEFT adapter",
                       parents=[common])
    p.add_argument("checkpoint", help="a run directory or its checkpoints/ directory (the newest step), or a "
                                      "step folder")
    p.add_argument("out_dir", help="the folder to write: new, empty, or holding an earlier export of the same run "
                                      "(other files, a README or .git, are kept; one the export would replace is "
                                      "refused)")
    p.add_argument("--adapter", action="store_true",
                   help="write the LoRA adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the weights' dtype in the folder (default: the run's parameter dtype, "
                        "execution.param_dtype; bfloat16 halves a float32 run's folder)")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("plan", help="HBM, host memory and transfer cost of a recipe on a GPU, without the GPU",
                       parents=[common])
    p.add_argument("recipe", help="a registered name, a recipe .json file, or module:function returning a Recipe")
    p.add_argument("--gpu", default=None,
                   help=f"target GPU (default: the recipe's offload.target_gpu, else {DEFAULT_GPU})")
    p.add_argument("--devices", type=int, default=None,
                   help="GPUs on one host (default: the recipe's offload.target_devices, else 1)")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field")
    p.add_argument("--host-ram-gb", type=_amount_in("GB"), default=None,
                   help="host RAM available for pinned memory, in GB (10^9 bytes; the plan shows GiB)")
    p.add_argument("--headroom", type=float, default=HBM_HEADROOM, help="fraction of HBM a plan may use")
    p.add_argument("--hbm-budget", type=_amount_in("GiB"), default=None, metavar="GIB",
                   help="HBM per GPU a plan may use, in GiB (with the headroom, the lower limit wins); "
                        "picks the fastest plan under it, or fails naming the smallest plan")
    p.add_argument("--host-update-rate", type=float, default=None, metavar="PARAMS_PER_S",
                   help="host CPU optimizer-update rate per core for host_compute plans (default: the file "
                        "benchmarks/host_update_rate.py wrote, else a measured default)")
    p.add_argument("--host-cores", type=float, default=None, metavar="N",
                   help="host CPU cores per GPU for the host update (default 8)")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the plan table (HBM, host bytes, limits, step time) to PATH")
    p.add_argument("--search", choices=["seq_len", "batch"], default=None,
                   help="also find the longest sequence / largest batch that fits per plan")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes at once (default: one per core, at most 4)")
    p.add_argument("--all-plans", action="store_true",
                   help="compile every candidate, also those with more in host memory than a plan that fits "
                        "with the same activations (by default skipped: they cannot be faster)")
    p.add_argument("--no-cache", action="store_true",
                   help="compile everything again instead of reading earlier compiles from the cache "
                        "(~/.cache/spillway/plan; SPILLWAY_PLAN_CACHE=0 does the same)")
    p.set_defaults(fn=_cmd_plan)
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe_error(err: BaseException) -> tuple[str, int]:
    """(one-line message, exit status) for an exception that ended a command.

    Expected failures say what is wrong; an OS error names the file and the
    reason (its own words, not a Python class name); anything else is a bug
    in spillway and is reported as one, shortened, with how to see more.
    """
    if isinstance(err, (SpillwayError, ValueError)):
        return _one_line(str(err)) or type(err).__name__, EXIT_USER_ERROR
    if isinstance(err, OSError):
        reason = err.strerror or _one_line(str(err)) or type(err).__name__
        if err.errno == errno.ENOSPC:
            from spillway.data.cache import DISK_FULL_ADVICE
            reason += f"; {DISK_FULL_ADVICE}"
        where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
        return (f"{where}: {reason}" if where else reason), EXIT_USER_ERROR
    if isinstance(err, MemoryError):
        return f"out of host memory ({_one_line(str(err)) or 'MemoryError'})", EXIT_USER_ERROR
    if (lost := _lost_another_process(err)) is not None:
        return lost, EXIT_USER_ERROR
    if "RESOURCE_EXHAUSTED" in str(err):   # XLA could not allocate: the settings asked too much, not a bug
        return (f"out of memory ({_one_line(str(err))[:_MAX_INTERNAL_MESSAGE]}); `spillway plan` prices a "
                f"recipe's memory before running it"), EXIT_USER_ERROR
    message = _one_line(f"{type(err).__name__}: {err}")
    if len(message) > _MAX_INTERNAL_MESSAGE:
        message = message[:_MAX_INTERNAL_MESSAGE] + " ..."
    return (f"internal error, please report it: {message} (rerun with --debug for the traceback)",
            EXIT_INTERNAL_ERROR)


def _lost_another_process(err: BaseException) -> str | None:
    """The line for a step of a multi-process run that failed because another process went away, else None."""
    if "spillway.recipes.train.distributed" not in sys.modules:   # no run of several processes started here
        return None
    from spillway.recipes.train.distributed import lost_another_process
    return lost_another_process(err)


def _leave_without_teardown(status: int) -> None:
    """Exit at once, past the interpreter's teardown: a Ctrl-C while XLA compiles leaves its compiler threads
    running, and tearing the interpreter down under them crashed the process (SIGSEGV after "interrupted").
    Everything the command holds was let go on the way here (the run lock, the checkpointer, in `finally`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return args.fn(args)   # tracebacks as Python prints them
    try:
        with interrupts_until_caught():   # a Ctrl-C that lands in a gc callback is not lost (recipes/ctrl_c.py)
            return args.fn(args)
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        # prepare keeps every shard it finished (data/cache.py: written whole or not at all)
        kept = {"prepare": " (what it finished is kept: the same command goes on from there)",
                # an export stopped midway has no config.json (recipes/export.py): nothing loads it as done
                "export": " (the same command writes the export; a folder it had begun to write holds no "
                          f"{'adapter_config.json' if getattr(args, 'adapter', False) else 'config.json'} "
                          "until then)"}.get(args.command, "")
        print(f"spillway {args.command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}{kept}",
              file=sys.stderr)
        status = EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
        if argv is None:   # the process's own command line, not a caller's: leave now (below)
            _leave_without_teardown(status)
        return status
    except BrokenPipeError:   # stdout's reader left (`spillway recipes tiny | head -1`): it had what it asked for
        if argv is None:   # the interpreter's last flush of stdout would fail again, loudly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as err:   # noqa: BLE001 - every failure becomes one line; --debug shows the traceback
        message, status = describe_error(err)
        print(f"spillway {args.command}: error: {message}", file=sys.stderr)
        if argv is None and _lost_another_process(err) is not None:
            # jax.distributed's shutdown at exit waits for the lost process (its 100 s heartbeat), then aborts
            # with pages of C++ log; the run let go of what it held on the way here
            _leave_without_teardown(status)
        return status


if __name__ == "__main__":
    sys.exit(main())
