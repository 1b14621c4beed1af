"""configs/glue.py: presets, overrides, and errors that list the valid choices."""

import pytest

from configs import glue


def test_defaults_are_the_papers():
  config = glue.get_config("rte")
  assert config.task == "rte"
  assert config.model == "bert-base-uncased"
  assert (config.max_length, config.batch_size, config.learning_rate) == (128, 32, 2e-5)
  assert (config.num_epochs, config.weight_decay, config.warmup_ratio) == (3, 0.01, 0.1)
  assert config.max_grad_norm == 1.0 and config.dropout == 0.1
  assert config.data.glue_dir is None
  # The paper's ACL-BERT: ACL-Embed + ACL-Grad (drop), anchors on samples and label embeddings.
  assert config.objective == "acl" and config.anchors == "all"
  assert config["lambda"] > 0 and config.temperature > 0


def test_lambda_and_temperature_presets():
  config = glue.get_config("rte,objective=scl,lambda=0.9,temperature=0.1")
  assert config.objective == "scl" and config["lambda"] == 0.9 and config.temperature == 0.1


def test_cl_weight_preset_sets_mu():
  config = glue.get_config("cola,multi_exit,objective=acl_cl,cl_weight=0.1")
  assert config.objective == "acl_cl" and config.cl_weight == 0.1
  with pytest.raises(ValueError, match="cl_weight='x'"):
    glue.get_config("cola,cl_weight=x")


def test_presets_set_fields():
  config = glue.get_config("mrpc,model=minilm,objective=ce,epochs=5,seed=3,max_steps=7,lr=3e-5")
  assert config.task == "mrpc" and config.model == "minilm" and config.objective == "ce"
  assert (config.num_epochs, config.seed, config.max_steps) == (5, 3, 7)
  # An explicit lr wins over the model preset's default.
  assert config.learning_rate == 3e-5


def test_model_preset_brings_its_learning_rate():
  assert glue.get_config("rte,model=minilm").learning_rate == glue.MODEL_DEFAULTS["minilm"][
      "learning_rate"]
  # A path or hub id keeps the paper's lr.
  assert glue.get_config("rte,model=/tmp/some/dir").model == "/tmp/some/dir"
  assert glue.get_config("rte,model=/tmp/some/dir").learning_rate == 2e-5


def test_regression_task_defaults_to_ce():
  assert glue.get_config("stsb").objective == "ce"
  assert glue.get_config("stsb,objective=acl").objective == "acl"  # refused by train, clearly


def test_multi_exit_presets():
  config = glue.get_config("rte,multi_exit,objective=acl_cl,gate=global,exit_weights=uniform,"
                           "exit_pooling=mean")
  assert config.multi_exit and config.objective == "acl_cl"
  assert (config.gate, config.exit_weights, config.exit_pooling) == ("global", "uniform", "mean")
  assert not glue.get_config("rte").multi_exit
  assert glue.get_config("rte,multi_exit").exit_pooling == "cls"  # METHOD.md's [CLS] exits


def test_task_aliases():
  assert glue.get_config("SST-2").task == "sst2"
  assert glue.get_config("sts-b").task == "stsb"


def test_unknown_task_lists_valid_ones():
  with pytest.raises(ValueError, match=r"(?s)rtee.*cola.*mrpc.*rte"):
    glue.get_config("rtee")


def test_unknown_preset_lists_valid_ones():
  with pytest.raises(ValueError, match=r"unknown preset 'epoch'.*epochs.*max_steps.*seed"):
    glue.get_config("rte,epoch=3")


def test_bad_preset_value_names_it():
  with pytest.raises(ValueError, match=r"seed='one'.*int"):
    glue.get_config("rte,seed=one")


def test_two_tasks_rejected():
  with pytest.raises(ValueError, match="two task names"):
    glue.get_config("rte,mrpc")
