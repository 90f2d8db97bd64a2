"""Fine-tuning runs through the `spillway` command: chat/instruct data, answers-only loss, `generate --chat`.

The cheap default-suite run trains a one-layer model for two steps on the shipped
instruction set (data/instruct_tiny.jsonl) with a sentencepiece tokenizer trained on
it and the built-in template, then answers a message with `spillway generate --chat`.
Bad input gets one line, exit status 2, before any step, and no checkpoint written.
The README's two-command chain (`spillway train tiny`, then `spillway train tiny_sft`)
is the slow test.
"""

import json
import os
import time
from pathlib import Path

import pytest

from spillway.data import train_tokenizer
from spillway.data.instruct_tiny import INSTRUCT_TINY, records
from spillway.data.sft_packing import TARGETS
from spillway.recipes import cli

SMALL_MODEL = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
               "model.mlp_hidden=64", "model.vocab_size=400"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A sentencepiece tokenizer (no chat template of its own) saved the way a run saves it."""
    directory = tmp_path_factory.mktemp("tokenizer")
    texts = [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" for r in records()]
    train_tokenizer(texts, vocab_size=400, cache_dir=directory / "cache").save_to_directory(directory)
    return directory


def run_args(tmp_path, tokenizer_dir, *extra, source=str(INSTRUCT_TINY)):
    sets = [f"data.source={source}", "data.format=instruct", "data.chat_template=spillway",
            f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128",
            "data.val_fraction=0.2", *SMALL_MODEL, "model.max_seq_len=128", "train.steps=2", "train.global_batch=8",
            "train.log_every=1",
            "train.eval_every=0", "train.sample_tokens=0", f"checkpoint.dir={tmp_path / 'run'}",
            *extra]
    return ["train", "tiny", *[arg for item in sets for arg in ("--set", item)]]


def test_instruct_run_trains_on_answers_and_answers_a_chat(tmp_path, tokenizer_dir, capsys):
    assert cli.main(run_args(tmp_path, tokenizer_dir)) == 0
    out = capsys.readouterr().out
    assert "280 examples" in out and "0 longer than a row truncated" in out
    saved = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert "### Assistant:" in saved["chat_template"]   # generate renders with what the run trained with
    # the prepared rows' folder (beside it, the lock its preparation held: data/sft_packing.py)
    rows = next(p for p in (tmp_path / "cache" / "sft").iterdir() if p.is_dir() and not p.name.startswith("."))
    import numpy as np
    train = np.load(rows / "train.npy")
    assert train.ndim == 3 and 0 < train[:, TARGETS].mean() < 0.6   # answers only: most tokens are prompt
    assert cli.main(["generate", str(tmp_path / "run"), "--chat", "Write a function that adds a and b.",
                     "--tokens", "5", "--temperature", "0"]) == 0
    answer = capsys.readouterr().out
    assert "### User" not in answer and "Write a function" not in answer   # only the answer is printed


def test_an_export_killed_while_writing_is_replaced_by_the_same_command(tmp_path, tokenizer_dir, capsys,
                                                                         monkeypatch):
    """An export stopped between its config and its weights (a kill, a full disk) left config.json and no
    record of which run wrote it, so the same command then refused the folder as someone else's. Now the
    folder it leaves names the run and holds no config.json (config.json comes last: transformers loaded a
    half-written export as a whole one), nor the part of the weights written."""
    # 16 embedding rows more than the tokenizer has ids, as Qwen2.5 has: no token, never sampled
    assert cli.main(run_args(tmp_path, tokenizer_dir, "train.steps=1", "train.sample_tokens=3",
                             "train.sample_prompt=Say hi.", "model.vocab_size=416")) == 0
    # the run's closing sample answers the prompt as a message, through the chat template
    assert "sample (the answer to 'Say hi.', through the chat template):" in capsys.readouterr().out
    out = tmp_path / "exported"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt   # Ctrl-C while the weights are written

    with monkeypatch.context() as patched:
        patched.setattr("safetensors.numpy.save_file", killed)
        assert cli.main(["export", str(tmp_path / "run"), str(out)]) == cli.EXIT_INTERRUPTED
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert not list(out.glob("*.partial"))
    assert json.loads((out / "spillway_export.json").read_text())["finished"] is False
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "run"), str(out)]) == 0
    said = capsys.readouterr().out
    assert "replacing its unfinished export of " in said, said
    assert (out / "model.safetensors").is_file()
    # the run's stop ids, which transformers' generate() reads (it took the family's defaults and ran on)
    from spillway.data import load_tokenizer
    eos = load_tokenizer(tmp_path / "run").eos_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    # ... and transformers' generate() must not pick the rows past the tokenizer's ids either
    ids = load_tokenizer(tmp_path / "run").vocab_size
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == list(range(ids, 416))
    assert f"generation_config.json: generation stops at token {eos}" in said
    # --dtype casts the folder's weights (a float32 run's bfloat16 export is half the size)
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "half"), "--dtype", "bfloat16"]) == 0
    assert "(bfloat16 weights)" in capsys.readouterr().out
    header_size = int.from_bytes((tmp_path / "half" / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "half" / "model.safetensors").read_bytes()[8:8 + header_size])
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    # both keys: transformers 4.56 on reads "dtype", earlier versions "torch_dtype"
    half_config = json.loads((tmp_path / "half" / "config.json").read_text())
    assert half_config["dtype"] == half_config["torch_dtype"] == "bfloat16"
    assert (tmp_path / "half" / "model.safetensors").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size
    record = (out / "spillway_export.json").read_text()
    assert json.loads(record)["finished"] is True
    assert str(tmp_path) not in record   # an export folder uploaded as it is carries no local path
    # generate on the export says what the folder is (it said "no checkpoint found (no finalised step folder)")
    capsys.readouterr()
    for named in (str(out), f"hf:{out}"):   # spelled as train's init_from takes it: was "does not exist"
        assert cli.main(["generate", named, "--prompt", "def"]) == cli.EXIT_USER_ERROR
        assert f"{out} is a Hugging Face checkpoint (config.json and *.safetensors), not a spillway run" in \
            capsys.readouterr().err
    _second_export_into_a_held_folder_waits_then_sees_the_first(tmp_path)


def _second_export_into_a_held_folder_waits_then_sees_the_first(tmp_path):
    """A new user's finding: two exports of different runs into one new folder both said "exported", the second
    having checked the folder before the first wrote its record; one run's export was the other's. An export
    now holds its folder: the second waits, then checks what the first wrote."""
    import fcntl
    import threading

    from spillway.recipes.export import export_run

    shared = tmp_path / "shared"
    shared.mkdir()
    said, errors = [], []
    held = os.open(shared, os.O_RDONLY)   # the first export, writing, holds the folder
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: _catching(errors, export_run, str(tmp_path / "run"), str(shared),
                                                            say=said.append))
        second.start()
        deadline = time.monotonic() + 120
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said == [f"waiting for the export writing into {shared} to finish"]
        # what the first export leaves: another run's export
        (shared / "config.json").write_text("{}")
        (shared / "spillway_export.json").write_text(json.dumps({"run": "other", "run_id": "x", "step": "8",
                                                                  "adapter": False, "finished": True}))
    finally:
        os.close(held)
    second.join(timeout=120)
    assert len(errors) == 1 and "holds an export of another run ('other'" in str(errors[0])
    assert (shared / "config.json").read_text() == "{}"   # the first's files untouched
    assert sorted(os.listdir(shared)) == ["config.json", "spillway_export.json"]   # no lock file left to publish


def _catching(errors, function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except Exception as error:   # noqa: BLE001 - the test reads it
        errors.append(error)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("data_format, rows, message", [
    ("instruct", [{"instruction": "a", "output": "b"}, {"instruction": "a", "answer": "b"}],
     r"data.format=instruct: record .*bad.jsonl, line 2 \(fields found: answer, instruction\) needs \"output\""),
    ("chat", [{"messages": [{"role": "narrator", "content": "x"}]}],
     r"bad.jsonl, line 1: role 'narrator' is not one the chat template built-in spillway knows"),
    ("chat", [{"text": "just text"}],
     r"bad.jsonl, line 1 \(fields found: text\) has no \"messages\" .*set data.format=text"),
    ("chat", [{"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]}],
     r"bad.jsonl, line 1: the chat template built-in spillway does not write the assistant's tool call "
     r"'get_weather' into its answer, .*use a chat template that renders \"tool_calls\""),
    ("chat", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "yo"}]}],
     r"bad.jsonl, line 1, message 1: \"from\" 'bing' is not a ShareGPT role read here \(human, "),
])
def test_bad_records_are_one_line_before_any_step(tmp_path, tokenizer_dir, capsys, data_format, rows, message):
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    code = cli.main(run_args(tmp_path, tokenizer_dir, f"data.format={data_format}", source=str(source)))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_chat_format_on_a_text_corpus_and_a_missing_template_are_refused(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("plain text\n")
    assert cli.main(run_args(tmp_path, tokenizer_dir, "data.format=chat", source=str(tmp_path / "corpus"))) == 2
    assert "is a text corpus (.txt files" in capsys.readouterr().err
    assert cli.main(run_args(tmp_path, tokenizer_dir, "data.chat_template=null")) == 2
    err = capsys.readouterr().err.strip()
    assert "has no chat template" in err and len(err.splitlines()) == 1
    (tmp_path / "broken.jinja").write_text("{{ messages[0]['content'] + 1 }}")
    assert cli.main(run_args(tmp_path, tokenizer_dir, f"data.chat_template={tmp_path / 'broken.jinja'}")) == 2
    err = capsys.readouterr().err.strip()
    assert "failed to render" in err and len(err.splitlines()) == 1


@pytest.mark.slow   # minutes on 2 busy cores: pretrains the tiny run, then fine-tunes it
def test_the_readme_chain_pretrain_then_fine_tune(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # runs/tiny, where tiny_sft's checkpoint.init_from points
    base = ["train", "tiny", "--set", "data.source=builtin:stdlib:1500000", "--set", "train.steps=40",
            "--set", "train.eval_every=0", "--set", "train.sample_tokens=0"]
    assert cli.main(base) == 0
    assert cli.main(["train", "tiny_sft", "--set", "train.steps=60"]) == 0
    history = [json.loads(line) for line in (tmp_path / "runs" / "tiny_sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in history if "loss" in row]
    assert losses[-1] < losses[0]
    capsys.readouterr()
    assert cli.main(["generate", "runs/tiny_sft", "--chat", "Write a function that adds a and b.",
                     "--temperature", "0", "--tokens", "30"]) == 0
    assert capsys.readouterr().out.strip()
    # ... and back to Hugging Face, its chat template beside the weights (the README's next line).
    assert cli.main(["export", "runs/tiny_sft", "out/tiny_sft"]) == 0
    exported = tmp_path / "out" / "tiny_sft"
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()
    assert json.loads((exported / "tokenizer_config.json").read_text())["chat_template"]
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(exported / "model.safetensors").st_mode & 0o777 == 0o666 & ~mask   # safetensors writes 0600
    # The same run exported again replaces its own export; another run's is refused, its export kept.
    capsys.readouterr()
    assert cli.main(["export", "runs/tiny_sft", "out/tiny_sft"]) == 0
    assert "replacing its export of " in capsys.readouterr().out
    kept = (exported / "model.safetensors").read_bytes()
    assert cli.main(["export", "runs/tiny", "out/tiny_sft"]) == 2
    assert "holds an export of another run" in capsys.readouterr().err
    assert (exported / "model.safetensors").read_bytes() == kept


def test_a_mixture_of_chat_sources_packs_each_whole_and_draws_rows_by_weight(tmp_path, tokenizer_dir):
    from spillway.recipes.config import DataConfig
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.data_pipeline import prepare

    def chat_file(name, count, answer):
        rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                              {"role": "assistant", "content": f"{answer} {i}"}]} for i in range(count)]
        return write_jsonl(tmp_path / name, rows)

    first, second = chat_file("a.jsonl", 60, "def a():"), chat_file("b.jsonl", 40, "return b")
    recipe = get_recipe("tiny")
    recipe = type(recipe).from_dict({**json.loads(recipe.to_json()), "data": dataclass_dict(DataConfig(
        format="chat", chat_template="spillway", tokenizer=str(tokenizer_dir), cache_dir=str(tmp_path / "cache"),
        seq_len=64, val_fraction=0.1, mixture=f"a=3:{first},b=1:{second}")), "train": {**json.loads(
        recipe.to_json())["train"], "eval_every": 0}})
    _, data = prepare(recipe)
    assert set(data.sources) == {"a", "b"} and data.weights == {"a": 0.75, "b": 0.25}
    batch = next(data.loader(recipe, 0, 1))
    assert batch.shape == (recipe.train.global_batch, 3, 65)


def dataclass_dict(config):
    import dataclasses
    return dataclasses.asdict(config)


def test_tiny_sft_before_its_base_run_exists_is_one_line_and_takes_no_run_directory(tmp_path, capsys, monkeypatch):
    """`spillway train tiny_sft` before `make train`: it said only "runs/tiny: no such checkpoint directory" and
    left an empty runs/tiny_sft/checkpoints behind, which `generate runs/tiny_sft` then misread. The line
    comes before the model's shapes are traced for the pinned limit (seconds for a large model)."""
    from spillway.recipes.train import host_memory

    def traced(recipe):
        raise AssertionError("the model's shapes were traced before the missing base was named")

    monkeypatch.setattr(host_memory, "pinned_need_of_recipe", traced)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "tiny_sft", "--set", "train.steps=2"]) == cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert "checkpoint.init_from 'runs/tiny' does not exist: train that run first (`spillway train tiny` writes " \
           "runs/tiny, what `make train` does)" in line
    assert not (tmp_path / "runs").exists()


def test_a_fine_tune_that_resumes_from_its_own_step_does_not_need_its_source(tmp_path, monkeypatch):
    """The missing-source line is for a fresh fine-tune: one resuming a step of its own reads no source (CI
    caught the first version refusing such a resume after the source was removed). A LoRA run reads its base
    at every start, so for it the line still comes."""
    from spillway.recipes.config import apply_overrides
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.preflight import MissingInputError, check_base_model_first

    monkeypatch.chdir(tmp_path)
    recipe = apply_overrides(get_recipe("tiny_sft"), ["checkpoint.init_from=gone-run"])
    with pytest.raises(MissingInputError, match="checkpoint.init_from 'gone-run' does not exist"):
        check_base_model_first(recipe)
    (tmp_path / recipe.run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-12").mkdir(parents=True)
    with pytest.raises(MissingInputError):   # an unfinished save is not a step to resume
        check_base_model_first(recipe)
    (tmp_path / recipe.run_dir / "checkpoints" / "2" / "params").mkdir(parents=True)   # a step: it holds items
    check_base_model_first(recipe)
    with pytest.raises(MissingInputError):   # ... unless told not to resume
        check_base_model_first(apply_overrides(recipe, ["train.resume=false"]))
    with pytest.raises(MissingInputError):
        check_base_model_first(apply_overrides(recipe, ["lora.rank=4"]))
    # an hf: base whose tokenizer the run folder no longer holds either: the line says to put it back
    with pytest.raises(MissingInputError, match="this run resumes from a step of its own, but its run folder "):
        check_base_model_first(apply_overrides(recipe, ["checkpoint.init_from=hf:gone-download"]))
    # a data.tokenizer removed since the run started: a resume tokenizes with the run folder's copy
    from spillway.recipes.train.preflight import check_run_inputs
    named_gone = apply_overrides(recipe, ["checkpoint.init_from=none", "data.tokenizer=gone/tokenizer.model"])
    with pytest.raises(MissingInputError, match="data.tokenizer 'gone/tokenizer.model' does not exist"):
        check_run_inputs(named_gone)
    (tmp_path / recipe.run_dir / "tokenizer.model").write_bytes(b"the run's copy")
    check_run_inputs(named_gone)
    with pytest.raises(MissingInputError, match="data.tokenizer 'gone/tokenizer.model' does not exist"):
        check_run_inputs(apply_overrides(named_gone, ["train.resume=false"]))


def test_a_full_fine_tune_of_an_hf_folder_resumes_after_the_folder_is_gone(tmp_path, tokenizer_dir, capsys):
    """A fine-tune of a downloaded checkpoint, stopped, resumes from its own step after the download was removed
    (it needed the folder for its tokenizer, though the run folder holds a copy); a fresh start still needs it."""
    import shutil

    assert cli.main(run_args(tmp_path, tokenizer_dir, "train.steps=1")) == 0
    base = tmp_path / "base"
    assert cli.main(["export", str(tmp_path / "run"), str(base)]) == 0
    fine_tune = run_args(tmp_path, tokenizer_dir, f"checkpoint.dir={tmp_path / 'ft'}", f"checkpoint.init_from=hf:{base}",
                         "data.tokenizer=none")
    assert cli.main([*fine_tune, "--stop-after", "1"]) == 0
    # a tokenizer of the same size that is not the checkpoint's is said (it trained quietly on the wrong ids)
    from spillway.recipes.config import apply_overrides
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.init_weights import resolve_init_from
    other = tmp_path / "other-tokenizer"
    train_tokenizer([f"{r['output']}\n{r['instruction']}" for r in records()], vocab_size=380,
                    cache_dir=other / "cache").save_to_directory(other)
    said = []
    resolve_init_from(apply_overrides(get_recipe("tiny"), [f"checkpoint.init_from=hf:{base}", *SMALL_MODEL,
                                                           "model.max_seq_len=128", f"data.tokenizer={other}"]),
                      said.append)
    assert any(line.startswith(f"warning: data.tokenizer '{other}' is not the checkpoint's own tokenizer")
               for line in said), said
    shutil.move(base, tmp_path / "moved")
    capsys.readouterr()
    assert cli.main(fine_tune) == 0
    said = capsys.readouterr().out
    assert "this run resumes from a step of its own, which holds the whole model" in said, said
    metrics = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert max(row.get("step", 0) for row in metrics) == 2
    # starting over needs the base: one line, the run folder kept
    assert cli.main([*fine_tune, "--set", "train.resume=false"]) == cli.EXIT_USER_ERROR
    assert f"checkpoint.init_from 'hf:{base}' does not exist" in capsys.readouterr().err


def test_a_chat_template_the_export_cannot_render_still_gives_the_eos(tokenizer_dir, tmp_path):
    """A text fine-tune keeps its base's chat template, which the run never rendered: where spillway's renderer
    cannot read it, the export still writes the EOS and says why the end of turn is missing (not fail)."""
    import shutil

    from spillway.data import load_tokenizer
    from spillway.recipes.export import _write_generation_ids

    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(tokenizer_dir, run, ignore=shutil.ignore_patterns("cache"))
    (run / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    out.mkdir()
    (out / "config.json").write_text("{}")
    from spillway.recipes.registry import get_recipe
    said = _write_generation_ids(run, out, get_recipe("tiny"))
    eos = load_tokenizer(run).eos_id
    assert said.startswith(f"; generation_config.json: generation stops at token {eos} (the chat template's end "
                           f"of turn not read: ")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos


def test_the_export_keeps_an_hf_bases_generation_config_under_the_runs_ids(tokenizer_dir, tmp_path):
    """Llama 3.1 Instruct's generation_config.json holds its sampling defaults and three stop ids (<|eom_id|>
    among them): the export of a fine-tune wrote the run's EOS alone. The base's stop ids count only where the
    run tokenizes with the base's own tokenizer."""
    import shutil

    from spillway.data import load_tokenizer
    from spillway.recipes.export import _write_generation_ids
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.base_generation import base_stop_ids

    base, run, out = tmp_path / "base", tmp_path / "run", tmp_path / "out"
    for folder in (base, run):
        shutil.copytree(tokenizer_dir, folder, ignore=shutil.ignore_patterns("cache"))
    eos = load_tokenizer(run).eos_id
    (base / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [eos, 5, 7, 50256], "do_sample": True, "temperature": 0.6,
         "top_p": 0.9}))
    out.mkdir()
    (out / "config.json").write_text("{}")
    recipe = get_recipe("tiny", [f"checkpoint.init_from=hf:{base}"])
    vocab = load_tokenizer(run).vocab_size   # 50256, GPT-2's default id in a config of a smaller vocabulary: left out
    assert _write_generation_ids(run, out, recipe).startswith(
        f"; generation_config.json: generation stops at token {eos} or 5 or 7 (the base's stop id 50256 left "
        f"out: not among the tokenizer's {vocab} ids)")
    # spillway generate and the closing sample stop where the export does (they stopped at the EOS alone)
    assert set(base_stop_ids(recipe, run, load_tokenizer(run))) == {eos, 5, 7}
    written = json.loads((out / "generation_config.json").read_text())
    assert (written["eos_token_id"], written["do_sample"], written["temperature"], written["top_p"]) == \
        ([eos, 5, 7], True, 0.6, 0.9)
    assert written["bos_token_id"] == load_tokenizer(run).bos_id   # the run's ids, not the base's
    (base / "tokenizer.model").write_bytes(b"another tokenizer")   # the base's stop ids would mean other tokens
    _write_generation_ids(run, out, recipe)
    written = json.loads((out / "generation_config.json").read_text())
    assert (written["eos_token_id"], written["temperature"]) == (eos, 0.6)


def test_the_bases_stop_ids_are_kept_with_the_run_and_its_fine_tunes(tokenizer_dir, tmp_path, monkeypatch):
    """The base's stop ids were read from its folder at every export and generate: a base moved since, a
    relative hf: path read from elsewhere, a fine-tune of the run lost them (generate ran past <|eom|>)."""
    import shutil

    from spillway.data import load_tokenizer
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.base_generation import base_stop_ids, keep_base_generation

    base, run, tuned = tmp_path / "base", tmp_path / "run", tmp_path / "tuned"
    for folder in (base, run, tuned):
        shutil.copytree(tokenizer_dir, folder, ignore=shutil.ignore_patterns("cache"))
    eos = load_tokenizer(run).eos_id
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 5], "temperature": 0.6}))
    recipe = get_recipe("tiny", [f"checkpoint.init_from=hf:{base}"])
    keep_base_generation(recipe, run, load_tokenizer(run).vocab_size)   # when the run starts
    shutil.rmtree(base)
    assert set(base_stop_ids(recipe, run, load_tokenizer(run))) == {eos, 5}
    from spillway.recipes.train import checkpoint   # a step of the run, which a fine-tune starts from
    monkeypatch.setattr(checkpoint, "resolve_step_dir", lambda path: Path(path))
    monkeypatch.setattr(checkpoint, "run_dir_of", lambda step: run)
    fine_tune = get_recipe("tiny", [f"checkpoint.init_from={run / 'checkpoints' / '3'}"])
    keep_base_generation(fine_tune, tuned, load_tokenizer(tuned).vocab_size)
    assert set(base_stop_ids(fine_tune, tuned, load_tokenizer(tuned))) == {eos, 5}


def test_a_fine_tune_resumes_after_its_source_run_was_removed(tokenizer_dir, tmp_path):
    """A resumed fine-tune looked for the base's stop ids in its source run and stopped with "no such
    checkpoint directory" where that run had been removed (a fine-tune needs nothing of it once started)."""
    import shutil

    from spillway.data import load_tokenizer
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.base_generation import BASE_GENERATION_FILE, keep_base_generation

    tuned = tmp_path / "tuned"
    shutil.copytree(tokenizer_dir, tuned, ignore=shutil.ignore_patterns("cache"))
    fine_tune = get_recipe("tiny", [f"checkpoint.init_from={tmp_path / 'removed-source'}"])
    keep_base_generation(fine_tune, tuned, load_tokenizer(tuned).vocab_size)
    assert not (tuned / BASE_GENERATION_FILE).exists()


def test_max_tokens_caps_a_fine_tune_and_keys_its_rows(tmp_path, tokenizer_dir):
    """data.max_tokens was ignored for chat/instruct data, the uncapped rows reused (README: any source)."""
    from spillway.recipes.config import DataConfig
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.data_pipeline import prepare

    def prepared(**capped):
        recipe = get_recipe("tiny")
        recipe = type(recipe).from_dict({**json.loads(recipe.to_json()), "data": dataclass_dict(DataConfig(
            source=str(INSTRUCT_TINY), format="instruct", chat_template="spillway", tokenizer=str(tokenizer_dir),
            cache_dir=str(tmp_path / "cache"), seq_len=128, val_fraction=0.1, **capped)), "train": {**json.loads(
            recipe.to_json())["train"], "eval_every": 0}})
        return prepare(recipe)[1].sources["corpus"]

    whole, capped = prepared(), prepared(max_tokens=3000)
    assert whole.num_documents == 280 and capped.path != whole.path
    assert capped.num_tokens <= 3000 and 0 < capped.num_documents < 280


def test_the_export_writes_a_bos_and_pad_the_run_does_not_have_as_null(tmp_path):
    """A run whose tokenizer puts no BOS (a tokenizer.json without a post-processor, GPT-2's or a ChatML one):
    the export left bos_token_id out of config.json, and transformers filled in the family's default (GPT-2's
    50256, past a small vocabulary; Mixtral's 1, another token)."""
    import tokenizers

    from spillway.data import load_tokenizer
    from spillway.recipes.export import _write_generation_ids
    from spillway.recipes.registry import get_recipe

    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    out.mkdir()
    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(run / "tokenizer.json"))
    (run / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(run).bos_id is None
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _write_generation_ids(run, out, get_recipe("tiny"))
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        assert written["bos_token_id"] is None and written["pad_token_id"] is None, (name, written)
        assert written["eos_token_id"] == 1


def test_the_export_finds_a_pad_token_that_is_an_ordinary_piece_of_a_sentencepiece_model(tokenizer_dir, tmp_path):
    """Gemma's <pad> (id 0) is a piece of its sentencepiece model, not one of the special tokens a chat template
    is matched against: the export wrote pad_token_id null over the base's 0."""
    import shutil

    from spillway.data import load_tokenizer
    from spillway.recipes.export import _write_generation_ids
    from spillway.recipes.registry import get_recipe

    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(tokenizer_dir, run, ignore=shutil.ignore_patterns("cache"))
    piece = load_tokenizer(run).token_text(7)
    config = json.loads((run / "tokenizer_config.json").read_text())
    (run / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": piece}))
    out.mkdir()
    (out / "config.json").write_text("{}")
    _write_generation_ids(run, out, get_recipe("tiny"))
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 7
    config["pad_token"] = "<not a piece>"
    (run / "tokenizer_config.json").write_text(json.dumps(config))
    _write_generation_ids(run, out, get_recipe("tiny"))
    assert json.loads((out / "config.json").read_text())["pad_token_id"] is None
