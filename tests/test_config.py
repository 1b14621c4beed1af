"""acl_jax.config: defaults, presets typed from the defaults, aliases, and validate()."""

import time

import pytest

from acl_jax import config as config_lib


def test_defaults_are_the_papers():
  config = config_lib.get_config("rte")
  assert config.task == "rte"
  assert config.model == "bert-base-uncased"
  assert (config.max_length, config.batch_size, config.learning_rate) == (128, 32, 2e-5)
  assert (config.num_epochs, config.weight_decay, config.warmup_ratio) == (3, 0.01, 0.1)
  assert config.max_grad_norm == 1.0 and config.dropout == 0.1
  assert config.data.glue_dir is None
  # The paper's ACL-BERT: ACL-Embed + ACL-Grad (drop), anchors on samples and label embeddings.
  assert config.objective == "acl" and config.anchors == "all"
  assert config.aux_weight > 0 and config.temperature > 0


def test_lambda_is_an_alias_of_aux_weight():
  config = config_lib.get_config("rte,objective=scl,lambda=0.9,temperature=0.1")
  assert config.objective == "scl" and config.aux_weight == 0.9 and config.temperature == 0.1
  assert "lambda" not in config
  assert config_lib.get_config("rte,aux_weight=0.3").aux_weight == 0.3


def test_cl_weight_preset_sets_mu():
  config = config_lib.get_config("cola,multi_exit,objective=acl_cl,cl_weight=0.1")
  assert config.objective == "acl_cl" and config.cl_weight == 0.1
  with pytest.raises(ValueError, match="cl_weight='x'"):
    config_lib.get_config("cola,cl_weight=x")


def test_presets_set_fields():
  config = config_lib.get_config("mrpc,model=minilm,objective=ce,epochs=5,seed=3,max_steps=7,"
                                 "lr=3e-5")
  assert config.task == "mrpc" and config.model == "minilm" and config.objective == "ce"
  assert (config.num_epochs, config.seed, config.max_steps) == (5, 3, 7)
  # An explicit lr wins over the model preset's default, wherever it stands in the string.
  assert config.learning_rate == 3e-5
  assert config_lib.get_config("rte,lr=3e-5,model=minilm").learning_rate == 3e-5


def test_any_scalar_field_is_a_preset_typed_by_its_default():
  config = config_lib.get_config("rte,log_every=1,kd_temperature=4,warmup_ratio=0,"
                                 "measure_conflict=true,matmul_precision=highest")
  assert config.log_every == 1 and isinstance(config.log_every, int)
  assert config.kd_temperature == 4.0 and isinstance(config.kd_temperature, float)
  assert config.warmup_ratio == 0.0 and config.measure_conflict is True
  assert config.matmul_precision == "highest"
  assert config_lib.get_config("rte,shard_params,measure_conflict=no").measure_conflict is False
  with pytest.raises(ValueError, match=r"log_every='1.5'.*int"):
    config_lib.get_config("rte,log_every=1.5")
  with pytest.raises(ValueError, match=r"multi_exit='maybe'.*bool"):
    config_lib.get_config("rte,multi_exit=maybe")
  with pytest.raises(ValueError, match=r"buckets.*unknown preset|data.*not a scalar"):
    config_lib.get_config("rte,data=1")


def test_model_preset_brings_its_learning_rate():
  assert config_lib.get_config("rte,model=minilm").learning_rate == config_lib.MODEL_DEFAULTS[
      "minilm"]["learning_rate"]
  # A path or hub id keeps the paper's lr.
  assert config_lib.get_config("rte,model=/tmp/some/dir").model == "/tmp/some/dir"
  assert config_lib.get_config("rte,model=/tmp/some/dir").learning_rate == 2e-5


def test_regression_task_defaults_to_ce_and_refuses_contrastive_objectives():
  assert config_lib.get_config("stsb").objective == "ce"
  with pytest.raises(ValueError, match=r"objective='acl'.*stsb.*regression.*objective=ce"):
    config_lib.get_config("stsb,objective=acl")


def test_multi_exit_presets_and_their_old_names():
  config = config_lib.get_config("rte,multi_exit,objective=acl_cl,gate_granularity=global,"
                                 "exit_weights=uniform,pooler_input=mean,pooler_weights=per_exit")
  assert config.multi_exit and config.objective == "acl_cl"
  assert (config.gate_granularity, config.exit_weights, config.pooler_input,
          config.pooler_weights) == ("global", "uniform", "mean", "per_exit")
  # The names recorded commands use.
  old = config_lib.get_config("rte,multi_exit,objective=acl_cl,gate=global,exit_weights=uniform,"
                              "exit_pooling=mean,pooler=per_exit")
  assert old.to_dict() == config.to_dict()
  assert not config_lib.get_config("rte").multi_exit
  assert config_lib.get_config("rte,multi_exit").pooler_input == "cls"  # the method's [CLS]


def test_task_aliases():
  assert config_lib.get_config("SST-2").task == "sst2"
  assert config_lib.get_config("sts-b").task == "stsb"


def test_unknown_task_lists_valid_ones():
  with pytest.raises(ValueError, match=r"(?s)rtee.*cola.*mrpc.*rte"):
    config_lib.get_config("rtee")


def test_unknown_preset_suggests_the_close_one_and_lists_all():
  with pytest.raises(ValueError, match=r"unknown preset 'epoch' \(did you mean 'epochs'\?\)"
                                       r".*max_steps.*seed.*epochs=num_epochs"):
    config_lib.get_config("rte,epoch=3")


def test_bad_preset_value_names_it():
  with pytest.raises(ValueError, match=r"seed='one'.*int"):
    config_lib.get_config("rte,seed=one")


def test_two_tasks_rejected():
  with pytest.raises(ValueError, match="two task names"):
    config_lib.get_config("rte,mrpc")


@pytest.mark.parametrize("field", sorted(config_lib.CHOICES))
def test_validate_rejects_an_unknown_value_of_every_enumerated_field(field):
  config = config_lib.get_config("rte,multi_exit")
  config[field] = "bogus"
  start = time.perf_counter()
  with pytest.raises(ValueError, match=rf"config\.{field}='bogus'; valid: "
                                       + ", ".join(config_lib.CHOICES[field])):
    config_lib.validate(config)
  assert time.perf_counter() - start < 0.5  # no checkpoint, data or compile behind it
  with pytest.raises(ValueError, match=rf"config\.{field}='bogus'"):
    config_lib.get_config(f"rte,multi_exit,{field}=bogus")


@pytest.mark.parametrize("preset, message", [
    ("rte,objective=acl_cl", r"objective='acl_cl' needs a multi-exit model"),
    ("rte,pooler_input=mean", r"pooler_input='mean' sets what multi-exit exits pool"),
    ("rte,temperature=0", r"temperature=0.0 must be positive"),
    ("rte,batch_size=0", r"batch_size=0 must be positive"),
    ("rte,gate_chunk=0", r"gate_chunk=0 must be >= 1"),
    ("rte,warmup_ratio=1.5", r"warmup_ratio=1.5 must be in \[0, 1\)"),
    ("rte,aux_weight=-1", r"aux_weight=-1.0 must be >= 0"),
    ("rte,wandb_entity=me", r"wandb_entity='me' .* set wandb_project too"),
])
def test_validate_rejects_inconsistent_values(preset, message):
  with pytest.raises(ValueError, match=message):
    config_lib.get_config(preset)


def test_validate_rejects_bad_exit_layers():
  config = config_lib.get_config("rte,multi_exit")
  config.exit_layers = (0, 2)
  with pytest.raises(ValueError, match=r"exit_layers=\(0, 2\): 0 is not a 1-based layer"):
    config_lib.validate(config)
