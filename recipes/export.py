"""`spillway export RUN_OR_STEP OUT_DIR [--adapter]`: a trained run back into a Hugging Face folder.

    spillway export runs/sft out/          config.json, model.safetensors, the run's tokenizer files:
                                           transformers loads it (LoRA adapters merged into the weights)
    spillway export runs/sft out/ --dtype bfloat16   the same, the weights cast (default: the run's dtype)
    spillway export runs/sft out/ --adapter   adapter_config.json + adapter_model.safetensors, the
                                           adapters alone, which `peft` loads onto the base model

The merged weights are W + (alpha / r) * B @ A per adapted projection, computed
in float32 and cast to the weight's dtype; models/hf.py `to_hf` writes them
under the family's Hugging Face names. The adapter folder is PEFT's LoRA
layout: `base_model.model.<module path>.lora_A.weight` [r, in] and `lora_B.weight`
[out, r] per layer, an adapter_config.json naming r, lora_alpha, lora_dropout,
target_modules and base_model_name_or_path (the run's `checkpoint.init_from`:
the Hub repository an `hf:` folder is a copy of, where the recipe names it,
else the folder's absolute path; a spillway run's step folder, which a user
exports first with `spillway export`).

The tokenizer files the run holds (tokenizer.json or tokenizer.model,
tokenizer_config.json with its chat template, special_tokens_map.json) are
copied beside the weights. Refused before anything is read or written, one line
each: an output folder holding another checkpoint (as `to_hf` refuses it; also
its tokenizer or generation files that this export would leave beside its own), a
folder holding weights that no export of this run wrote (another run's export,
a downloaded checkpoint: `spillway_export.json` records which run an export
holds (its folder's name, a digest of its path, the step), so that a later
export of the same run replaces it; it is written before
the weights, so an export killed midway is replaced too), a training run's
directory or its checkpoints folder (the run's own tokenizer files would be
replaced), `--adapter` on a run without LoRA, and a run of a user's block (recipe `block`), which no
Hugging Face class computes.

Writing: one export at a time into a folder (a lock on the folder: a second waits, then checks what the first
wrote); the earlier export's config.json (adapter_config.json) goes first and the new one comes
last, whole, after the weights and tokenizer files: an export stopped midway (a kill, a full disk) leaves a
folder that transformers does not load, whose record says unfinished, which the same command completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spillway.data.chat_template_files import CHAT_TEMPLATE_DIR, named_template_files
from spillway.layers.errors import ConfigError
from spillway.layers.lora import ADAPTER_PREFIX, fused_adapter_name
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh, state_shardings
from spillway.models.hf import HFCheckpointError, listed, save_safetensors
from spillway.recipes.train.base_generation import GENERATION_CONFIG, base_generation_config, hf_base_json
from spillway.recipes.train.run_identity import run_identity
from spillway.recipes.config import Recipe
from spillway.recipes.readable_step import restore_readable, saved_recipe

EXPORT_RECORD = "spillway_export.json"   # which run an export folder holds: a later export replaces only its own
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_WEIGHTS = "model.safetensors"
CONFIG = "config.json"
STAGED_CONFIG = "config.json.partial"   # the merged export's config.json until its last field is in
PEFT_PREFIX = "base_model.model."
# (and additional_chat_templates/*.jinja, transformers 5's named chat templates: data/chat_template_files.py)
HF_TOKENIZER_JSON = "tokenizer.json"
# The tokenizer_class of a tokenizer.json the export makes: transformers' generic fast tokenizer, which reads the
# file as it is (transformers 5 loads it as TokenizersBackend)
GENERIC_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Model types whose tokenizer transformers' AutoTokenizer loads with the family's class, whatever the folder
# names (`_class_forced_note`)
CLASS_FORCED_MODEL_TYPES = ("qwen2",)
TOKENIZER_FILES = (HF_TOKENIZER_JSON, "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# Files of a Hugging Face checkpoint that transformers reads beside the weights and an export never writes.
READ_BESIDE = ("generation_config.json", "added_tokens.json", "vocab.json", "merges.txt")


def _check_out_dir(out_dir: Path, own: str, tokenizer_files: list[str]) -> None:
    """The same refusal as models/hf.py to_hf: a folder holding another checkpoint (safetensors files
    other than the one this export writes, or a safetensors index); and files of another checkpoint that
    transformers reads beside the weights but this export would leave in place (`tokenizer_files`: those it
    copies): a tokenizer.json left beside the run's tokenizer.model is the tokenizer AutoTokenizer loads,
    a chat_template.jinja overrides the template in tokenizer_config.json, a generation_config.json sets
    the EOS that generate() stops at."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise HFCheckpointError(f"{out_dir} exists and is not a folder")
    others = sorted(p for p in out_dir.glob("*.safetensors") if p.name != own)
    others += sorted(out_dir.glob("*.safetensors.index.json"))
    others += [out_dir / name for name in (*TOKENIZER_FILES, *READ_BESIDE)
               if name not in tokenizer_files and (out_dir / name).is_file()]
    others += [path for path in named_template_files(out_dir)
               if f"{CHAT_TEMPLATE_DIR}/{path.name}" not in tokenizer_files]
    if others:
        raise HFCheckpointError(f"{out_dir} already holds another checkpoint ({listed(others)}): export into "
                                f"an empty folder, or delete those files first")


def _source_of(run_dir, step_dir) -> str:
    return str(Path(run_dir if run_dir is not None else step_dir).resolve())


def _run_id(source: str) -> str:
    """What the record keeps of the run: the id kept in its folder (recipes/train/run_identity.py: it goes with
    the folder when the run is moved or copied), else a digest of its path (a run from before ids were kept);
    never the path itself, so an export folder published as it is (`hf upload`) does not carry the local paths
    of the machine it was made on."""
    return run_identity(Path(source)) or _path_id(source)


def _path_id(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _ids_of(source: str) -> set[str]:
    """Every id an earlier export of this run may have recorded: its kept id, and its path's digest (an export
    made where it is before the run kept an id)."""
    return {_run_id(source), _path_id(source)}


def _check_earlier_export(out_dir: Path, own: str, source: str, writes: list[str]) -> str | None:
    """An output folder already holding a file this export writes (its weights, config, or `writes`: the
    tokenizer files and generation_config.json) is replaced only when its export record names the same run: an
    export of another run, or a folder with no record (a downloaded or transformers-saved checkpoint, a
    tokenizer download, an export of older code), is refused, nothing written. Other files (a README, a git
    clone's .git) are left as they are. Returns what the earlier export of this run was ("its export of step
    40", "its unfinished export of step 40": one killed while writing), or None for a fresh folder."""
    config = ADAPTER_CONFIG if own == ADAPTER_WEIGHTS else "config.json"
    present = [out_dir / name for name in (own, config, *writes) if (out_dir / name).is_file()]
    if not present:
        return None
    try:
        record = json.loads((out_dir / EXPORT_RECORD).read_text())
        earlier_run, earlier_id, earlier_step = record["run"], record["run_id"], record["step"]
    except (OSError, ValueError, KeyError, TypeError):
        raise HFCheckpointError(f"{out_dir} already holds {listed(present)} that no spillway export recorded "
                                f"({EXPORT_RECORD} missing or unreadable): export into an empty folder, or delete "
                                f"those files first") from None
    if earlier_id not in _ids_of(source):
        raise HFCheckpointError(f"{out_dir} holds an export of another run ({earlier_run!r}, not {source}): export "
                                f"into an empty folder, or delete it first")
    return f"its {'' if record.get('finished', True) else 'unfinished '}export of step {earlier_step}"


def _check_not_a_run(out_dir: Path) -> None:
    """A training run's own folders are not export targets: into a run directory, the export's
    tokenizer_config.json would replace the run's (how it tokenizes on resume, its chat template) and its
    weights would sit beside the checkpoints; into `checkpoints/`, orbax would meet a folder it never wrote.
    A new folder inside a run directory (`runs/sft/hf`) is fine."""
    from spillway.recipes.train.checkpoint_items import CHECKPOINTS_DIRNAME
    from spillway.recipes.train.run_lock import LOCK_FILENAME

    out = out_dir.absolute()
    if out.resolve() in (Path("/"), Path.home().resolve()):   # files among everything else there, `/` as root
        what = "the filesystem's root" if out.resolve() == Path("/") else "your home folder"
        raise HFCheckpointError(f"{out_dir} is {what}: export into a folder of its own, e.g. {out_dir / 'hf'}")
    if out.is_dir() and ((out / CHECKPOINTS_DIRNAME).is_dir() or (out / LOCK_FILENAME).exists()):
        raise HFCheckpointError(f"{out_dir} is a training run's directory (it holds {CHECKPOINTS_DIRNAME}/ or "
                                f"{LOCK_FILENAME}): an export there would overwrite the run's tokenizer files; "
                                f"export into a new folder, e.g. {out_dir / 'hf'}")
    for folder in (out, *out.parents):
        if folder.name == CHECKPOINTS_DIRNAME and folder.parent.is_dir() and (
                (folder.parent / LOCK_FILENAME).exists() or any(p.name.isdigit() for p in folder.iterdir())):
            raise HFCheckpointError(f"{out_dir} is inside the checkpoints folder of the run {folder.parent}, "
                                    f"where the run keeps its steps; export into a folder outside it")


def export_run(path: str, out_dir: str, *, adapter: bool = False, dtype: str | None = None, say=print) -> Path:
    """Write the Hugging Face (or, with `adapter`, PEFT) folder of the run or step `path` into `out_dir`."""
    from spillway.recipes.train.checkpoint import resolve_step_dir, run_dir_of
    from spillway.recipes.train.checkpoint_dirs import without_hf_prefix
    from spillway.recipes.train.tokenization_record import require_tokenizer_copy

    step_dir = resolve_step_dir(without_hf_prefix(path))
    recipe = saved_recipe(step_dir)
    if adapter and not recipe.lora.enabled:
        raise ConfigError(f"--adapter: the run at {path} has no LoRA adapters (lora.rank is 0, every weight "
                          f"trained): export it without --adapter")
    if recipe.block is not None:   # its weights would load into the family's own block, computing another model
        raise ConfigError(f"the run at {path} trains the block {recipe.block}, which no Hugging Face model class "
                          f"computes (transformers would load its weights into {recipe.family}'s own layers, a "
                          f"different model): export writes runs of the zoo's own blocks only")
    if not adapter:
        _refuse_a_model_no_config_holds(recipe)
    out = Path(out_dir)
    _check_not_a_run(out)
    run_dir = run_dir_of(step_dir)
    own = ADAPTER_WEIGHTS if adapter else MERGED_WEIGHTS
    writes = _written_tokenizer_files(run_dir) + ([GENERATION_CONFIG] if not adapter and run_dir is not None else [])
    _check_out_dir(out, own, writes)
    source = _source_of(run_dir, step_dir)
    _check_earlier_export(out, own, source, writes)   # before minutes of reading; again once the folder is held
    if not adapter and run_dir is not None:   # its generation ids read the tokenizer: checked before any write
        require_tokenizer_copy(run_dir)   # (it left a half-written folder)
    read = _read_for_export(path, step_dir, adapter)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):   # named as the folder, not as the first temporary file refused in it
        raise HFCheckpointError(f"{out_dir} is not writable: export into a folder you can write")
    with _holding(out, say):   # one export at a time into a folder: the second sees what the first wrote
        _check_out_dir(out, own, writes)
        replaced = _check_earlier_export(out, own, source, writes)
        return _write_export(read, out, source, replaced, adapter=adapter, dtype=dtype, say=say)


@contextlib.contextmanager
def _holding(out: Path, say):
    """The export folder itself locked for the block (flock on the folder: no lock file is left in what may be
    published): a second export into it (of another run, which checked the folder while the first read its
    checkpoint) replaced the first's files; now it waits, then finds the first's record. The lock goes with
    its process: a killed export holds nothing."""
    folder = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for the export writing into {out} to finish")
            fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)   # (closing lets go of the lock)


@dataclasses.dataclass
class _Read:
    """What an export writes, read from the step before its folder is touched."""
    step_dir: Path
    recipe: Recipe
    params: object
    run_dir: Path | None
    tower: str | None
    adapter_tensors: dict | None


def _read_for_export(path: str, step_dir, adapter: bool) -> _Read:
    """The step's recipe and weights (for `adapter`, the PEFT tensors too), nothing written."""
    from spillway.recipes.train.checkpoint import run_dir_of
    from spillway.recipes.train.step import abstract_model, abstract_with_shardings

    mesh = make_mesh(MeshConfig(1, -1, 1), devices=jax.devices()[:1])

    def target_of(saved: Recipe):
        _, abstract_state = abstract_model(saved)
        return abstract_with_shardings(abstract_state, state_shardings(abstract_state, mesh))

    # a live run's retention may delete the step before it is read: the run's newest is read then (the record
    # below names the step exported)
    # an adapter export reads the adapters alone: it works where the base has gone since
    step_dir, recipe, params = restore_readable(path, step_dir, target_of, with_base=not adapter)
    tower = _text_tower(recipe, run_dir_of(step_dir)) if adapter else None   # the base's layout: before writing
    adapter_tensors = peft_tensors(recipe, params, tower) if adapter else None   # what PEFT cannot hold: before too
    return _Read(step_dir, recipe, params, run_dir_of(step_dir), tower, adapter_tensors)


def _write_export(read: _Read, out: Path, source: str, replaced: str | None, *, adapter: bool,
                  dtype: str | None, say) -> Path:
    """export_run's writing, its folder held."""
    step_dir, recipe, run_dir = read.step_dir, read.recipe, read.run_dir
    # The record comes first: an export killed while writing leaves a folder that names this run, so the
    # same command replaces it (written last, the rerun met weights no export had recorded, and refused).
    _write_record(out, source, step_dir, adapter, finished=False)
    # The config that makes the folder loadable goes first and comes back last, whole: an export stopped
    # midway (a kill, a full disk) leaves no folder transformers loads, neither the new half nor the old.
    (out / (ADAPTER_CONFIG if adapter else CONFIG)).unlink(missing_ok=True)
    copied = _copy_tokenizer(Path(run_dir), out) if run_dir is not None else []
    if adapter:
        write_peft_adapter(recipe, read.adapter_tensors, out, read.tower)
        stops, weights = "", ""
    else:
        write_merged(recipe, read.params, out, dtype=dtype, config_name=STAGED_CONFIG)
        stops = _write_generation_ids(Path(run_dir), out, recipe, STAGED_CONFIG) if run_dir is not None else ""
        _keep_base_context(recipe, out, STAGED_CONFIG)
        written = json.loads((out / STAGED_CONFIG).read_text())
        (out / STAGED_CONFIG).replace(out / CONFIG)
        weights = f" ({written.get('dtype')} weights)"
        stops += _class_forced_note(copied, written.get("model_type")) + _text_only_note(recipe, run_dir)
    _write_record(out, source, step_dir, adapter, finished=True)
    say(f"exported {step_dir} to {out}" + (" (PEFT adapter)" if adapter else weights)
        + (f", replacing {replaced}" if replaced else "")
        + (f"; tokenizer: {', '.join(copied)}" if copied else "; no tokenizer files in the run") + stops)
    if adapter:
        _say_how_to_load_on_a_spillway_base(recipe, out, say)
    return out


def _say_how_to_load_on_a_spillway_base(recipe: Recipe, out: Path, say) -> None:
    """An adapter trained on a spillway step (not an hf: folder) names that step as its base, which transformers
    cannot load (AutoPeftModelForCausalLM fails on it): say how to export the base and load the adapter onto it."""
    init_from = recipe.checkpoint.init_from or ""
    if not init_from or init_from.startswith("hf:"):
        return
    base = Path(init_from).expanduser().absolute()
    gone = "" if base.exists() else " (no longer there: export it from a copy)"
    say(f"its base is the spillway step {base}{gone}, which transformers does not load: export it too "
        f"(spillway export {base} BASE_DIR) and load the adapter onto that, "
        f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE_DIR), {str(out)!r})")


def _write_record(out: Path, source: str, step_dir, adapter: bool, *, finished: bool) -> None:
    """spillway_export.json: which run the folder holds, and whether its export finished."""
    _write_json(out / EXPORT_RECORD, {"run": Path(source).name, "run_id": _run_id(source),
                                      "step": Path(step_dir).name, "adapter": adapter, "finished": finished})


def _write_generation_ids(run_dir: Path, out: Path, recipe: Recipe, config_name: str = CONFIG) -> str:
    """The run's BOS, EOS and pad ids into config.json, and a generation_config.json whose eos_token_id lists
    every token that ends an answer (a chat run's end-of-turn tokens too, as `spillway generate --chat` stops):
    without them transformers takes the family's default ids, and generate() ran past the end of a turn. An
    hf: base's generation_config.json is kept under them: its sampling defaults, and its stop ids beside the
    run's where the run tokenizes with the base's tokenizer. Returns what the export's line says of it."""
    from spillway.data.tokenizer import named_special_token
    from spillway.recipes.train.chat_prompt import end_of_turn_in_run
    from spillway.recipes.train.tokenization_record import run_tokenizer

    tokenizer = run_tokenizer(run_dir)
    stops, unread = [tokenizer.eos_id], ""
    try:
        stops += [i for i in end_of_turn_in_run(run_dir, tokenizer) if i not in stops]
    except Exception as error:   # noqa: BLE001 - a template kept from a base, which this run never rendered
        # (a text fine-tune of an instruct model): its end of turn is a refinement, not worth the export
        unread = f" (the chat template's end of turn not read: {' '.join(str(error).split())[:120]})"
    base_settings, base_stops, past_vocab = base_generation_config(recipe, run_dir, tokenizer.vocab_size)
    stops += [i for i in base_stops if i not in stops]
    if past_vocab:   # transformers would warn of them at every load; they can never be generated
        unread += (f" (the base's stop id{'s' if len(past_vocab) > 1 else ''} "
                   f"{', '.join(map(str, past_vocab))} left out: not among the tokenizer's {tokenizer.vocab_size} ids)")
    # written when None too (null): a key left out is the family's default to transformers (GPT-2's BOS 50256,
    # Mixtral's 1, Gemma's pad 0), an id of some other token of this run's tokenizer, or of none
    pad = named_special_token(run_dir, "pad_token")   # a special token, or a piece of a sentencepiece model (<pad>)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops[0] if len(stops) == 1 else stops,
           "pad_token_id": None if pad is None else tokenizer.id_of_token(pad)}
    config = json.loads((out / config_name).read_text())
    _write_json(out / config_name, {**config, **ids})
    # embedding rows past the tokenizer's ids (Qwen2.5: 151,936 rows, 151,665 ids) are no token: `spillway
    # generate` never samples them (sampling.py vocab_limit), and transformers must not either
    padding = list(range(tokenizer.vocab_size, config.get("vocab_size", tokenizer.vocab_size)))
    suppressed = sorted(set(base_settings.get("suppress_tokens") or []) | set(padding))
    _write_json(out / GENERATION_CONFIG, {**base_settings, **ids, **({"suppress_tokens": suppressed}
                                                                      if suppressed else {})})
    never = f"; ids {padding[0]}-{padding[-1]} (no token) suppressed" if padding else ""
    return f"; {GENERATION_CONFIG}: generation stops at token {' or '.join(str(i) for i in stops)}{never}{unread}"


def _keep_base_context(recipe: Recipe, out: Path, config_name: str = CONFIG) -> None:
    """config.json's max_position_embeddings as the `hf:` base's where the run fine-tuned at a shorter
    model.max_seq_len (RoPE positions are computed: the weights serve the base's length; the export said the
    fine-tune's, and transformers warned past it). Left as written where the base folder is not found."""
    found = hf_base_json(recipe, "config.json")
    base = found[1].get("max_position_embeddings") if found is not None else None
    if recipe.decoder_spec().learned_positions or not isinstance(base, int) or base <= recipe.model.max_seq_len:
        return
    config = json.loads((out / config_name).read_text())
    _write_json(out / config_name, {**config, "max_position_embeddings": base})


def _write_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, replaced whole (a kill leaves the old file or the new, never half of one)."""
    from spillway.data.cache import atomic_write_bytes
    atomic_write_bytes(path, (json.dumps(value, indent=2) + "\n").encode())


def _tokenizer_files(run_dir) -> list[str]:
    """The tokenizer files the run holds, which the export copies (its named chat templates' files too)."""
    if run_dir is None:
        return []
    return ([name for name in TOKENIZER_FILES if (Path(run_dir) / name).is_file()]
            + [f"{CHAT_TEMPLATE_DIR}/{path.name}" for path in named_template_files(Path(run_dir))])


def _written_tokenizer_files(run_dir) -> list[str]:
    """The tokenizer files the export writes: the run's, and a tokenizer.json made of its sentencepiece model."""
    return _tokenizer_files(run_dir) + ([HF_TOKENIZER_JSON] if _converts_sentencepiece(run_dir) else [])


def _copy_tokenizer(run_dir: Path, out: Path) -> list[str]:
    """The run's tokenizer files copied into `out`, each whole (a full disk left a truncated tokenizer.model),
    and the tokenizer.json of its sentencepiece model where `_converts_sentencepiece` says so."""
    from spillway.data.cache import atomic_write_bytes

    copied = _tokenizer_files(run_dir)
    for name in copied:
        (out / name).parent.mkdir(exist_ok=True)
        atomic_write_bytes(out / name, (run_dir / name).read_bytes())
    if not _converts_sentencepiece(run_dir):
        return copied
    from spillway.data.spm_json import tokenizer_json
    from spillway.recipes.train.tokenization_record import run_tokenizer

    tokenizer = run_tokenizer(run_dir)
    bos = (tokenizer.token_text(tokenizer.bos_id), tokenizer.bos_id) if tokenizer.adds_bos else None
    atomic_write_bytes(out / HF_TOKENIZER_JSON, tokenizer_json(tokenizer.model_proto, bos).encode())
    # the generic class reads tokenizer.json as it is; the family's class (GPT-2's, Gemma's) rebuilds its own
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    _write_json(out / "tokenizer_config.json", {**config, "tokenizer_class": GENERIC_TOKENIZER_CLASS})
    return copied + [f"{HF_TOKENIZER_JSON} (its sentencepiece model, as transformers reads it)"]


def _class_forced_note(copied: list[str], model_type) -> str:
    """What the export's line adds where transformers' AutoTokenizer reads the tokenizer.json made of the run's
    sentencepiece model with another class whatever tokenizer_config.json names (transformers 5.25 lists the
    model types whose checkpoints' named class it overrides; of the zoo's, qwen2: Qwen2's byte-level BPE)."""
    if model_type not in CLASS_FORCED_MODEL_TYPES or not any(name.startswith(HF_TOKENIZER_JSON) for name in copied):
        return ""
    return (f"; transformers' AutoTokenizer reads every {model_type} tokenizer as its own byte-level BPE, which "
            f"misreads this one: load it with PreTrainedTokenizerFast.from_pretrained(DIR)")


def _converts_sentencepiece(run_dir) -> bool:
    """Whether the export writes a tokenizer.json of the run's tokenizer.model (data/spm_json.py): for a
    sentencepiece model whose tokenizer_config.json names no transformers class (one spillway trained, a bare
    .model), which transformers would rebuild as the model family's class: GPT-2's and Qwen's byte-level BPE
    misread every text, Gemma's made a unigram model BPE and dropped the model's normalizer. A folder naming its
    class (a Llama 2 checkpoint's LlamaTokenizer) is read as transformers reads that checkpoint."""
    if run_dir is None:
        return False
    run_dir = Path(run_dir)
    config_path = run_dir / "tokenizer_config.json"
    if (run_dir / HF_TOKENIZER_JSON).is_file() or not (run_dir / "tokenizer.model").is_file():
        return False
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError):
        return False   # copied as it is; reading the run's tokenizer says what is wrong with it
    # add_prefix_space: false is a transformers class's setting (the model's dummy prefix dropped): left to it
    if not isinstance(config, dict) or config.get("tokenizer_class") or config.get("add_prefix_space") is False:
        return False
    from spillway.data.spm_json import unsupported_reason

    return unsupported_reason((run_dir / "tokenizer.model").read_bytes()) is None


def _adapters(recipe: Recipe, params) -> list[tuple[tuple[tuple, ...], np.ndarray, np.ndarray]]:
    """(paths of the weights an adapter adapts, A [L, r, in], B [L, out, r]) of each adapter, as float32 NumPy:
    one weight, or a fused adapter's parts in their order (its B's rows are theirs, joined in that order)."""
    fused = {fused_adapter_name(parts): parts for _, parts in recipe.lora_spec().fused_targets}
    flat = dict(nnx.to_flat_state(params))
    found = []
    for path, var in flat.items():
        if isinstance(var, nnx.LoRAParam) and path[-1] == "a":
            holder, name = path[:-2], path[-2]
            parts = fused.get(name, (name[len(ADAPTER_PREFIX):],))
            b = flat[path[:-1] + ("b",)]
            found.append((tuple(holder + (part,) for part in parts),
                          np.asarray(jax.device_get(var.get_value()), np.float32),
                          np.asarray(jax.device_get(b.get_value()), np.float32)))
    return found


def merged_state(recipe: Recipe, params):
    """(graphdef, state) of the recipe's model without adapters, each adapted weight W + (alpha / r) B A."""
    from spillway.recipes.train.lora_step import split
    from spillway.recipes.train.step import abstract_model

    graphdef, _ = abstract_model(recipe.without_adapters())
    if not recipe.lora.enabled:
        return graphdef, params
    scale = recipe.lora.alpha / recipe.lora.rank
    base = dict(nnx.to_flat_state(split(params)[1]))
    for weights, a, b in _adapters(recipe, params):
        start = 0
        for path in weights:
            w = base[path]
            value = np.asarray(jax.device_get(w.get_value()), np.float32)
            # A fused adapter's part: the rows of B of this weight's outputs (its size over the shared input).
            rows = b.shape[-2] if len(weights) == 1 else value[0].size // a.shape[-1]
            # [L, in, out]: A^T B^T per layer; [L, E, in, out] per layer and expert for routed experts
            delta = np.einsum("...ri,...or->...io", a, b[..., start:start + rows, :]) * scale
            start += rows
            base[path] = w.replace(jnp.asarray(value + delta.reshape(value.shape), w.get_value().dtype))
    return graphdef, nnx.from_flat_state(list(base.items()))


def _refuse_a_model_no_config_holds(recipe: Recipe) -> None:
    """Builds the config.json the merged export writes (models/hf.py to_hf) from the recipe alone, so that the
    family's refusal of a model no config.json holds (a Gemma 3 with a cap) comes before any file is written."""
    from spillway.models.hf import HFCheckpointError, config_refusal

    refusal = config_refusal(recipe.without_adapters().model)
    if refusal is not None:
        raise HFCheckpointError(refusal)


def write_merged(recipe: Recipe, params, out: Path, dtype: str | None = None, config_name: str = CONFIG) -> None:
    from spillway.models.hf import to_hf
    graphdef, state = merged_state(recipe, params)
    to_hf(nnx.merge(graphdef, state), out, dtype=dtype, config_name=config_name)


def _hf_names(recipe: Recipe) -> dict[tuple, str]:
    """{block weight path (module, weight): Hugging Face tensor name with {i}}."""
    from spillway.models.registry import get_family
    table = get_family(recipe.family).hf
    return {w.path: w.hf_name for w in table.weights(recipe.model) if w.per_layer and not w.per_expert}


def _base_name(recipe: Recipe) -> str:
    """adapter_config.json's base_model_name_or_path: the Hub repository the base is a copy of where the recipe
    names one (checkpoint.init_from_origin, as PEFT's own exports name it), else the base folder as an absolute
    path (a relative one was relative to wherever the run was trained)."""
    init_from = recipe.checkpoint.init_from or ""
    if init_from.startswith("hf:") and recipe.checkpoint.init_from_origin:
        return recipe.checkpoint.init_from_origin
    return str(Path(init_from.removeprefix("hf:")).expanduser().absolute()) if init_from else ""


# Where transformers keeps a multimodal Gemma 3's text layers (Gemma3ForConditionalGeneration), for PEFT's names.
MULTIMODAL_TEXT_TOWER = "model.language_model."
_TEXT_MODEL = "model."


def _text_tower(recipe: Recipe, run_dir) -> str:
    """The module path of the base's text layers as transformers builds it: `model.`, or for a multimodal Gemma 3
    base `model.language_model.` (an adapter named `model.layers.*` loaded there with no effect, PEFT only
    warning of missing keys). Read from the hf: base's config.json, else from the copy the run kept of it when
    it started (the base may have gone since: the adapters are all an adapter export reads); ConfigError where
    neither can be read."""
    from spillway.recipes.train.base_generation import kept_base_config
    from spillway.recipes.train.init_weights import hf_checkpoint_dir

    directory = hf_checkpoint_dir(recipe.checkpoint.init_from)
    if directory is None or recipe.family != "gemma3":   # only Gemma 3 has a multimodal form here
        return _TEXT_MODEL
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        config = kept_base_config(run_dir) if run_dir is not None else None
        if config is None:   # a run started before the copy was kept
            raise ConfigError(f"--adapter: the base's {directory / 'config.json'} cannot be read ({error}), and it "
                              f"says whether the adapters load into a multimodal Gemma 3; put the base back "
                              f"there") from None
    return MULTIMODAL_TEXT_TOWER if isinstance(config, dict) and config.get("model_type") == "gemma3" else _TEXT_MODEL


def _text_only_note(recipe: Recipe, run_dir) -> str:
    """A merged export of a run on a multimodal Gemma 3 holds its text model alone (spillway reads and trains the
    text tower): said, since the base loaded as an image-text model and nothing else in the line tells."""
    try:
        multimodal = _text_tower(recipe, run_dir) == MULTIMODAL_TEXT_TOWER
    except ConfigError:   # the base and the run's copy of its config gone: nothing to say of it
        return ""
    return ("; the base's vision tower is not in it (the text tower alone was trained): a Gemma3ForCausalLM that "
            "AutoModelForCausalLM loads, for text" if multimodal else "")


def _refuse_names_peft_reads_as_experts(recipe: Recipe, module: str) -> None:
    """A dense MLP of a model with routed experts (Qwen3-MoE's mlp_only_layers) shares its projections' names with
    the experts', and PEFT on transformers 5 (experts fused) puts such targets on the experts: the adapter loaded
    with no effect, or PEFT refused it. ConfigError before anything is written."""
    from spillway.recipes.lora_targets import expert_projections

    expert_names = {name.rsplit(".", 1)[-1] for name in expert_projections(recipe.model)}
    if module.rsplit(".", 1)[-1] in expert_names:
        raise ConfigError(f"--adapter: the run adapts the dense MLP ({module.replace('{i}', 'N')}) of a model with "
                          f"routed experts, whose projections have the same names, and PEFT places such targets on "
                          f"the routed experts (the adapter would load with no effect); export merged instead")


def _expert_targets(recipe: Recipe, shown: str) -> str:
    """The lora.targets that name routed experts' projections, as the user wrote them ("w1, w2"); else the
    adapted parameter's path."""
    from spillway.recipes.lora_targets import EXPERTS, expert_projections, names_module

    experts = expert_projections(recipe.model)
    named = [t for t in recipe.lora.targets if t == EXPERTS or any(names_module(t, m) for m in experts)]
    return f"lora.targets {', '.join(named)}" if named else shown


def peft_tensors(recipe: Recipe, params, tower: str) -> dict[str, np.ndarray]:
    """{PEFT tensor name: array} of the run's adapters, per layer under its Hugging Face module name; a model
    with several runs of layers (Qwen3-MoE's dense layers among the sparse ones) numbers each run's layers from
    its first; `tower` is where the base keeps its text layers (`_text_tower`). ConfigError for what PEFT's
    layout cannot hold: computed before anything is written."""
    from spillway.models.hf import stack_runs

    names = _hf_names(recipe)
    runs = stack_runs({path: np.shape(value.get_value()) for path, value in nnx.to_flat_state(params)})
    tensors = {}
    for weights, a, b in _adapters(recipe, params):
        shown = ".".join(str(part) for part in weights[0])
        if a.ndim == 4:
            raise ConfigError(f"--adapter: the run adapts the routed experts ({_expert_targets(recipe, shown)}), "
                              f"which the PEFT "
                              f"export does not map in this version (transformers lays MoE experts out "
                              f"differently across versions); export merged instead")
        prefix, first = next(((prefix, first) for prefix, first in runs if weights[0][:len(prefix)] == prefix),
                             (None, 0))
        modules = {names.get(path[len(prefix):]) for path in weights} if prefix is not None else {None}
        if len(modules) != 1 or None in modules:   # a fused adapter's parts are one Hugging Face tensor
            raise ConfigError(f"--adapter: the adapter of {shown} has no Hugging Face module name; export "
                              f"merged instead")
        module = modules.pop().removesuffix(".weight")
        _refuse_names_peft_reads_as_experts(recipe, module)
        if module.startswith(_TEXT_MODEL):
            module = tower + module[len(_TEXT_MODEL):]
        for layer in range(a.shape[0]):
            name = PEFT_PREFIX + module.format(i=first + layer)
            tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a[layer])
            tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b[layer])
    return tensors


def write_peft_adapter(recipe: Recipe, tensors: dict[str, np.ndarray], out: Path, tower: str) -> None:
    """adapter_config.json and adapter_model.safetensors as PEFT saves a LoRA adapter (`peft_tensors`, with the
    same `tower`)."""
    from spillway.recipes.lora_targets import hf_modules, stored_in_out

    spec = recipe.lora_spec()
    modules = hf_modules(recipe.model, spec)
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if tower != _TEXT_MODEL:
        # bare names (q_proj) match the vision tower's modules too: a regex PEFT full-matches, the text layers only
        targets = rf"{re.escape(tower)}layers\.\d+\.({'|'.join(re.escape(m) for m in modules)})"
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": recipe.lora.rank, "lora_alpha": recipe.lora.alpha,
        "lora_dropout": recipe.lora.dropout, "target_modules": targets,
        # Conv1D projections (GPT-2) are stored [in, out]: PEFT's flag for them (lora_A/lora_B are the same).
        "base_model_name_or_path": _base_name(recipe), "bias": "none", "fan_in_fan_out": stored_in_out(recipe.model),
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None,
    }
    save_safetensors(tensors, out / ADAPTER_WEIGHTS)   # the weights, then the config that makes them an adapter
    _write_json(out / ADAPTER_CONFIG, config)
