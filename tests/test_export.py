"""--mode=export: transformers' PyTorch BertForSequenceClassification gives our logits."""

import json

import numpy as np
import pytest
import safetensors.numpy

from acl_jax import data
from acl_jax import hf_weights
from acl_jax import run_dir
from acl_jax import train
from conftest import tiny_run_config


def torch_logits(export_dir, batch):
  import torch
  import transformers
  model = transformers.BertForSequenceClassification.from_pretrained(export_dir).eval()
  with torch.no_grad():
    out = model(**{k: torch.tensor(np.asarray(batch[k]), dtype=torch.long)
                   for k in data.MODEL_INPUTS})
  return out.logits.numpy()


def first_dev_batch(run):
  encoded = run.load_encoded("validation")
  return next(data.eval_batches(encoded, batch_size=16, boundaries=run.boundaries))


@pytest.mark.parametrize("preset", ["rte,objective=ce",
                                    "rte,multi_exit,pooler_weights=per_exit,objective=ce"])
def test_export_loads_in_transformers_with_the_same_logits(tiny_bert_dir, glue_dir, tmp_path,
                                                           preset):
  config = tiny_run_config(tiny_bert_dir, glue_dir, f"{preset},max_steps=3",
                           learning_rate=1e-2)
  if config.multi_exit:
    config.exit_layers = (1,)  # the final exit below the last layer: a truncated encoder
  train.train_and_evaluate(config, tmp_path / "run")
  run = run_dir.load_trained_run(tmp_path / "run")
  out = hf_weights.export_hf(run, run.workdir / run_dir.EXPORT_DIR)
  batch = first_dev_batch(run)
  ours = run.model.apply({"params": run.params}, *(batch[k] for k in data.MODEL_INPUTS))
  ours = np.asarray(ours["logits"][-1] if config.multi_exit else ours["logits"])
  np.testing.assert_allclose(torch_logits(out, batch), ours, atol=1e-5, rtol=1e-5)

  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["architectures"] == ["BertForSequenceClassification"]
  assert hf_config["id2label"] == {"0": "entailment", "1": "not_entailment"}
  assert (out / "vocab.txt").exists() or (out / "tokenizer.json").exists()
  if config.multi_exit:
    assert hf_config["num_hidden_layers"] == 1
    heads = safetensors.numpy.load_file(out / hf_weights.EXIT_HEADS_FILE)
    assert set(heads) == {"exit_1.classifier.weight", "exit_1.classifier.bias",
                          "exit_1.pooler.dense.weight", "exit_1.pooler.dense.bias"}
    np.testing.assert_array_equal(heads["exit_1.classifier.weight"],
                                  np.asarray(run.params["exit_1"]["classifier"]["kernel"]).T)


def test_every_exit_head_is_in_the_sidecar_file(tiny_bert_dir, glue_dir, tmp_path):
  """Exit 1's sidecar head on HF's hidden_states[1], pooled by bert.pooler, gives our exit-1
  logits: the sidecar is enough to rebuild every exit in PyTorch."""
  import torch
  import transformers
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,multi_exit,objective=ce,max_steps=2",
                           learning_rate=1e-2)
  train.train_and_evaluate(config, tmp_path / "run")
  run = run_dir.load_trained_run(tmp_path / "run")
  out = hf_weights.export_hf(run, run.workdir / run_dir.EXPORT_DIR)
  heads = safetensors.numpy.load_file(out / hf_weights.EXIT_HEADS_FILE)
  assert set(heads) == {f"exit_{e}.classifier.{p}" for e in (1, 2) for p in ("weight", "bias")}
  batch = first_dev_batch(run)
  model = transformers.BertForSequenceClassification.from_pretrained(out).eval()
  with torch.no_grad():
    hidden = model.bert(**{k: torch.tensor(np.asarray(batch[k]), dtype=torch.long)
                           for k in data.MODEL_INPUTS}, output_hidden_states=True).hidden_states
    pooled = model.bert.pooler(hidden[1])
    logits = (pooled @ torch.tensor(heads["exit_1.classifier.weight"]).T
              + torch.tensor(heads["exit_1.classifier.bias"])).numpy()
  ours = run.model.apply({"params": run.params}, *(batch[k] for k in data.MODEL_INPUTS))
  np.testing.assert_allclose(logits, np.asarray(ours["logits"][0]), atol=1e-5, rtol=1e-5)
