"""Hugging Face checkpoint folders a user may hand over: one checkpoint each, whole files, finite weights.

* `to_hf` into a folder holding a sharded checkpoint refused naming it (it used
  to leave the old index and shards, which `from_hf` then read instead of the
  new model.safetensors); a second export over the first replaces it;
* `from_hf` refuses a folder holding two checkpoints, naming both;
* a truncated .safetensors file is an error naming the file;
* a NaN inside imported weights is an error naming the tensor (not, later,
  "lower the learning rate");
* a base model's save (`LlamaModel.save_pretrained`: no `model.` on its names,
  no head) loads where its head is the tied embedding, as transformers loads it
  (it was refused as a list of 20 missing and 20 unexpected tensors); untied, or a
  classifier's save, it is refused naming the head it lacks;
* Mistral's repositories (Mistral-7B-v0.3) hold their own format's
  consolidated.safetensors beside transformers' shards and index: transformers
  reads the shards, and from_hf refused the folder as holding two checkpoints;
* a PEFT adapter's folder with its base's config.json copied beside it is named
  as the adapter (its tensors were read as the model's: every tensor missing).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from spillway.layers.execution import Execution
from spillway.models.decoder import DecoderLM
from spillway.models.hf import HFCheckpointError, export_hf_state_dict, from_hf, to_hf
from spillway.models.registry import preset_config

SMALL = dict(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=64, max_seq_len=32)


@pytest.fixture(scope="module")
def model():
    return DecoderLM(preset_config("llama", "tiny", **SMALL), Execution(), rngs=nnx.Rngs(0))


def write_sharded(directory, tensors: dict[str, np.ndarray]) -> list[str]:
    """tensors as two shards and the index transformers writes for them; returns the shard names."""
    from safetensors.numpy import save_file

    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in members})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return list(shards)


def embedding(model_or_dir) -> np.ndarray:
    return np.asarray(model_or_dir.embed.table[...])


def test_an_export_into_a_folder_holding_a_sharded_checkpoint_is_refused_naming_it(model, tmp_path):
    to_hf(model, tmp_path)
    stale = {n: t * 2 for n, t in export_hf_state_dict(model).items()}
    (tmp_path / "model.safetensors").unlink()
    write_sharded(tmp_path, stale)
    with pytest.raises(HFCheckpointError, match=r"already holds another checkpoint \(model.safetensors.index.json, "
                                                r"model-00001-of-00002.safetensors"):
        to_hf(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()   # nothing written beside it
    # an export over an export replaces it: one checkpoint, the new weights
    fresh = tmp_path / "fresh"
    to_hf(DecoderLM(preset_config("llama", "tiny", **SMALL), Execution(), rngs=nnx.Rngs(1)), fresh)
    to_hf(model, fresh)
    assert sorted(p.name for p in fresh.iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(embedding(from_hf(fresh)), embedding(model))


def test_from_hf_refuses_a_folder_holding_two_checkpoints_naming_both(model, tmp_path):
    to_hf(model, tmp_path)
    write_sharded(tmp_path, {n: t * 2 for n, t in export_hf_state_dict(model).items()})
    with pytest.raises(HFCheckpointError, match=r"holds two checkpoints: the shards model.safetensors.index.json "
                                                r"lists \(model-00001-of-00002.safetensors, "
                                                r"model-00002-of-00002.safetensors\) and model.safetensors"):
        from_hf(tmp_path)


def test_a_pytorch_bin_checkpoint_is_refused_with_the_conversion_to_run(model, tmp_path):
    to_hf(model, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")   # an older checkpoint's only weights
    with pytest.raises(FileNotFoundError, match=r"found \['pytorch_model.bin'\]: only safetensors checkpoints are "
                                                r"read; convert it .*M.from_pretrained\(old\)"
                                                r"\.save_pretrained\(new\); T.from_pretrained\(old\)\.save_pretrained"
                                                r"\(new\)"):
        from_hf(tmp_path)


def test_a_truncated_safetensors_file_is_named(model, tmp_path):
    to_hf(model, tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(HFCheckpointError, match=rf"{file}: .*truncated"):
        from_hf(tmp_path)


def test_a_nan_in_imported_weights_names_the_tensor(model, tmp_path):
    tensors = export_hf_state_dict(model)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] = np.nan
    from safetensors.numpy import save_file
    to_hf(model, tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=rf"tensor {name!r} holds 1 NaN or infinite values"):
        from_hf(tmp_path)


def save_as_the_base_model(model, directory, extra=None):
    """`model` as a base model's save_pretrained writes it: its tensors without "model.", no lm_head."""
    from safetensors.numpy import save_file

    to_hf(model, directory)
    tensors = {n.removeprefix("model."): t for n, t in export_hf_state_dict(model).items() if n != "lm_head.weight"}
    save_file({**tensors, **(extra or {})}, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_a_base_models_save_loads_where_its_head_is_tied_and_is_refused_naming_the_head_where_not(model, tmp_path):
    tied = DecoderLM(preset_config("llama", "tiny", **SMALL, tie_embeddings=True), Execution(), rngs=nnx.Rngs(2))
    save_as_the_base_model(tied, tmp_path / "tied")
    loaded = export_hf_state_dict(from_hf(tmp_path / "tied"))
    assert all(np.array_equal(loaded[n], t) for n, t in export_hf_state_dict(tied).items())
    save_as_the_base_model(model, tmp_path / "untied")
    with pytest.raises(HFCheckpointError, match=r"^the Hugging Face checkpoint has no output head \(lm_head.weight\) "
                                                r"and its config.json says tie_word_embeddings=false: .*\(a base model, "
                                                r"or a classifier\); spillway reads a causal LM's checkpoint "
                                                r"\(LlamaForCausalLM\)[^\n]*$"):
        from_hf(tmp_path / "untied")
    from safetensors.numpy import save_file
    to_hf(model, tmp_path / "classifier")   # LlamaForSequenceClassification: its score.weight for the head
    classifier = {n: t for n, t in export_hf_state_dict(model).items() if n != "lm_head.weight"}
    classifier["score.weight"] = np.zeros((3, SMALL["d_model"]), np.float32)
    save_file(classifier, str(tmp_path / "classifier" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"no output head .* or a classifier: score.weight\)"):
        from_hf(tmp_path / "classifier")


def test_a_base_models_save_gives_transformers_logits(transformers, tmp_path):
    import torch

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.model.save_pretrained(tmp_path)   # LlamaModel: what transformers loads as this causal LM
    tokens = np.arange(3, 15)[None]
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).logits.numpy()
    ours = from_hf(tmp_path, dtype="float32", param_dtype="float32")(tokens)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-4, atol=1e-4)


def test_mistrals_own_consolidated_file_beside_the_shards_is_left_to_mistral_inference(model, tmp_path):
    from safetensors.numpy import save_file

    tensors = export_hf_state_dict(model)
    mistral_names = {n.removeprefix("model.").replace("self_attn.q_proj", "attention.wq"): t for n, t in tensors.items()}
    sharded, single, alone = tmp_path / "sharded", tmp_path / "single", tmp_path / "alone"
    for folder in (sharded, single, alone):
        to_hf(model, folder)
        save_file(mistral_names, str(folder / "consolidated.safetensors"), metadata={"format": "pt"})
    (sharded / "model.safetensors").unlink()
    write_sharded(sharded, tensors)
    for folder in (sharded, single):   # transformers reads the shards (or model.safetensors), and so does from_hf
        np.testing.assert_array_equal(embedding(from_hf(folder)), embedding(model))
    (alone / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match=r"holds only Mistral's own format \(consolidated.safetensors, read "
                                                r"with params.json by mistral-inference\), which transformers does "
                                                r"not read: fetch the repository's model-\*.safetensors"):
        from_hf(alone)


def test_an_adapters_folder_with_its_bases_config_beside_it_is_named_as_the_adapter(model, tmp_path):
    to_hf(model, tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "adapter_model.safetensors")   # what PEFT saves
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base",
                                                              "peft_type": "LORA"}))
    with pytest.raises(HFCheckpointError, match=rf"^{tmp_path} is a PEFT adapter \(adapter_config.json\), not a "
                                                r"model: it adapts /models/base\. Name that base model's folder"):
        from_hf(tmp_path)


def test_a_file_system_that_refuses_modes_still_gets_the_export(tmp_path, monkeypatch):
    """A CIFS or vfat mount owned by another user refuses chmod: the export wrote its weights whole and then
    stopped on PermissionError, leaving model.safetensors.partial, at every rerun."""
    import errno
    import os

    from spillway.models import hf

    def refused(path, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    partial = tmp_path / "model.safetensors.partial"
    partial.write_bytes(b"weights")
    monkeypatch.setattr(os, "chmod", refused)
    hf.put_in_place(partial, tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights" and not partial.exists()


def test_a_full_disk_while_the_weights_are_written_is_the_os_error_naming_the_file(tmp_path, monkeypatch):
    """A new user's finding: safetensors' SafetensorError ("I/O error: No space left on device (os error 28)")
    names no file, and `spillway export` called it an internal error; the part written was left behind."""
    import errno

    import safetensors.numpy

    from spillway.models.hf import save_safetensors

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as partial:
            partial.write(b"half")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError) as error:
        save_safetensors({"w": np.zeros(3, np.float32)}, tmp_path / "model.safetensors")
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(tmp_path / "model.safetensors")
    assert list(tmp_path.iterdir()) == []
    from spillway.recipes.cli import describe_error
    line, _ = describe_error(error.value)
    assert line.startswith(f"{tmp_path / 'model.safetensors'}: No space left on device; free space on that disk")
