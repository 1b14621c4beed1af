"""Experiment tracking: a crashed and resumed multi-exit run's TensorBoard events, read back
with TensorBoard's own reader, and its W&B run (offline mode), against metrics.jsonl."""

import importlib.util
import json
import struct

import numpy as np
import pytest
from tensorboard.plugins.hparams import plugin_data_pb2

from acl_jax import config as config_lib
from acl_jax import run_dir
from acl_jax import tracking
from acl_jax import train
from conftest import tensorboard_scalars, tiny_run_config


class _Crash(Exception):
  pass


def metrics_rows(workdir):
  return [json.loads(line) for line in (workdir / run_dir.METRICS_FILE).read_text().splitlines()]


def expected_scalars(rows, exit_layers):
  """{tag: [(step, value)]} of metrics.jsonl, as float32 (TensorBoard's scalar type)."""
  out = {}
  for row in rows:
    for tag, value in tracking.scalars({k: v for k, v in row.items() if k != "step"},
                                       exit_layers).items():
      out.setdefault(tag, []).append((row["step"], np.float32(value)))
  return out


def wandb_history(run_file):
  """{step: {key: value}} of an offline W&B run file (`run-<id>.wandb`): wandb 0.31 has no
  Python reader, so the LevelDB log framing its records come in is read here (the layout of
  wandb's former sdk/internal/datastore.py); each record is wandb's own protobuf."""
  from wandb.proto import wandb_internal_pb2
  data = run_file.read_bytes()
  assert data[:4] == b":W&B"
  block, position, pending, history = 32768, 7, b"", {}
  while position + 7 <= len(data):
    if block - position % block < 7:  # a block's tail too short for a header is padding
      position += block - position % block
      continue
    _, length, kind = struct.unpack("<IHB", data[position:position + 7])
    pending += data[position + 7:position + 7 + length]
    position += 7 + length
    if kind in (1, 4):  # a full record, or the last piece of one
      record = wandb_internal_pb2.Record.FromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "history":
        row = history.setdefault(record.history.step.num, {})
        row.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item if not item.key.startswith("_")})
  return history


def test_scalars_split_per_exit_terms_by_layer_and_drop_strings():
  row = {"loss": 0.5, "ce": [0.7, 0.6], "stage": "train", "epoch": 1}
  assert tracking.scalars(row, (2, 4)) == {"loss": 0.5, "ce/exit2": 0.7, "ce/exit4": 0.6,
                                           "epoch": 1.0}
  assert set(tracking.scalars(row)) == {"loss", "ce/exit1", "ce/exit2", "epoch"}
  with pytest.raises(ValueError):  # exits and values must match one to one
    tracking.scalars(row, (2, 4, 6))


def test_without_the_extras_tensorboard_is_skipped_and_wandb_refused(tmp_path, monkeypatch,
                                                                     caplog):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None
                      if name in ("tensorboard", "wandb") else find_spec(name, *args))
  config = config_lib.get_config("rte")
  trackers = tracking.open_trackers(config, tmp_path, first_step=1, wandb_run_id=None)
  assert trackers.trackers == () and not (tmp_path / run_dir.TENSORBOARD_DIR).exists()
  assert "pip install 'acl_jax[tensorboard]'" in caplog.text
  config.wandb_project = "p"
  with pytest.raises(ImportError, match=r"wandb_project='p' needs wandb: pip install"):
    tracking.check_installed(config)


def test_tensorboard_false_writes_no_event_files(tmp_path):
  config = config_lib.get_config("rte,tensorboard=false")
  trackers = tracking.open_trackers(config, tmp_path, first_step=1, wandb_run_id=None)
  assert trackers.trackers == () and not (tmp_path / run_dir.TENSORBOARD_DIR).exists()


def test_a_crashed_and_resumed_run_tracks_exactly_metrics_jsonl(tiny_bert_dir, glue_dir,
                                                                tmp_path, monkeypatch):
  """A multi-exit ACL run (per-exit ce and aux, the global gate's dot, cosine and kept,
  per-exit dev metrics; one bucket, so one compiled step) crashes at step 8 with its checkpoint at step 4 and the rows of steps 6 and 8
  already logged, then resumes: TensorBoard's reader returns every metrics.jsonl scalar once,
  with the resumed process's values, and the config as hyper-parameters; the W&B run (offline)
  keeps its id and holds the same history."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path))
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = tiny_run_config(tiny_bert_dir, glue_dir,
                           "rte,multi_exit,objective=acl,gate_granularity=global,max_steps=8,"
                           "checkpoint_every=4,eval_every=4,wandb_project=acl_jax_test",
                           learning_rate=1e-3, max_length=32)
  workdir = tmp_path / "run"
  original = run_dir.RunCheckpoints.save

  def crash_before_saving_step_8(self, step, state, progress):
    if step == 8:
      self.wait()  # step 4's checkpoint is on disk, as after a kill at this point
      raise _Crash(step)
    original(self, step, state, progress)
  with monkeypatch.context() as patch:
    patch.setattr(run_dir.RunCheckpoints, "save", crash_before_saving_step_8)
    with pytest.raises(_Crash):
      train.train_and_evaluate(config, workdir)
  crashed_rows = metrics_rows(workdir)
  assert [r["step"] for r in crashed_rows if "loss" in r] == [2, 4, 6, 8]
  run_id = json.loads((workdir / run_dir.CONFIG_FILE).read_text())["meta"]["wandb_run_id"]

  results = train.train_and_evaluate(config, workdir)
  assert results["checkpoints"]["resumed_from_step"] == 4
  rows = metrics_rows(workdir)
  assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6, 8]
  # The resumed process measured its own speed, so TensorBoard must hold its rows, not the
  # crashed process's.
  assert rows[-3]["examples_per_s"] != crashed_rows[-3]["examples_per_s"]

  expected = expected_scalars(rows, (1, 2))
  assert {"ce/exit1", "aux/exit2", "dot", "cosine", "kept", "grad_norm",
          "lr", "eval/validation/exit2/accuracy", "eval/validation/avg/accuracy"} <= set(expected)
  scalars, reader = tensorboard_scalars(workdir / run_dir.TENSORBOARD_DIR)
  assert scalars == expected
  assert len(list((workdir / run_dir.TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2

  saved = json.loads((workdir / run_dir.CONFIG_FILE).read_text())
  session = [plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
             for content in reader.PluginTagToContent("hparams").values()][0]
  logged = {key: getattr(value, value.WhichOneof("kind"))
            for key, value in session.hparams.items()}
  assert logged == {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                    else v for k, v in tracking.hparams(config).items()}
  assert logged["objective"] == "acl" and logged["multi_exit"] is True
  assert logged["max_steps"] == 8 and logged["data.buckets"] == "[32]"
  assert logged["gate_granularity"] == "global"

  # W&B: the rerun resumed the run config.json names; offline, each process leaves its own
  # run directory with that id: the crashed one's history, then the resumed one's.
  assert saved["meta"]["wandb_run_id"] == run_id
  run_dirs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*"))
  assert len(run_dirs) == 2
  first, second = (wandb_history(d / f"run-{run_id}.wandb") for d in run_dirs)
  assert sorted(first) == [2, 4, 6, 8] and sorted(second) == [6, 8]
  for row in rows:
    logged = {**first, **second}[row["step"]]
    values = tracking.scalars({k: v for k, v in row.items() if k != "step"}, (1, 2))
    assert {k: logged[k] for k in values} == pytest.approx(values, rel=1e-6)
