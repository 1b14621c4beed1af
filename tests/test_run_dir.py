"""Checkpoints and resume: kill -9 mid-run, rerun, and land on the same bits; refusals."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from etils import epath

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import hf_weights
from acl_jax import run_dir
from acl_jax import train
from conftest import REPO_ROOT, tiny_run_config, train_until_crash_after_save

RECORDS = sorted((REPO_ROOT / "experiments/results/records").glob("**/config.json"))


def _command(model_dir, workdir, preset):
  return [sys.executable, "-m", "acl_jax.main",
          f"--config=configs/glue.py:rte,model={model_dir},{preset}",
          "--config.log_every=1", f"--workdir={workdir}"]


def _env(glue_dir, cache_dir):
  return {**os.environ, "GLUE_DIR": str(glue_dir), "ACL_JAX_CACHE": str(cache_dir),
          "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}


def _final_params(workdir):
  meta = json.loads((workdir / "config.json").read_text())["meta"]
  params, step = run_dir.load_params(workdir)
  return step, meta, params


def test_kill_9_then_rerun_matches_an_uninterrupted_run_bitwise(tiny_bert_dir, glue_dir,
                                                                 tmp_path):
  """A real training subprocess is SIGKILLed after some checkpoint; the same command resumes
  it; its final parameters (and optimizer state, via the next steps) equal the reference's."""
  preset = "objective=acl,max_steps=40,checkpoint_every=3,batch_size=8,max_length=32,eval_every=16"
  env = _env(glue_dir, tmp_path / "cache")
  reference, resumed = tmp_path / "reference", tmp_path / "resumed"
  subprocess.run(_command(tiny_bert_dir, reference, preset), cwd=REPO_ROOT, env=env, check=True,
                 capture_output=True)

  proc = subprocess.Popen(_command(tiny_bert_dir, resumed, preset), cwd=REPO_ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  latest = resumed / "checkpoints" / "latest"
  deadline = time.time() + 300
  # Kill as soon as a mid-run checkpoint is complete (orbax renames a finished step to its
  # number): the run then has work left to redo and a metrics tail to drop.
  while time.time() < deadline and proc.poll() is None:
    steps = [int(p.name) for p in latest.glob("*") if p.name.isdigit()] if latest.exists() else []
    if steps and 9 <= max(steps) < 40:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.01)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-run"
  assert not (resumed / "eval_results.json").exists()
  killed_at = max(int(p.name) for p in latest.glob("*") if p.name.isdigit())

  subprocess.run(_command(tiny_bert_dir, resumed, preset), cwd=REPO_ROOT, env=env, check=True,
                 capture_output=True)
  ref_step, _, ref_params = _final_params(reference)
  res_step, res_meta, res_params = _final_params(resumed)
  assert ref_step == res_step == 40
  assert res_meta["resumed_from_step"] == killed_at
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(ref_params),
                        jax.tree.leaves(ref_params), jax.tree.leaves(res_params)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), f"{path[0]} differs after resume"

  ref_results = json.loads((reference / "eval_results.json").read_text())
  res_results = json.loads((resumed / "eval_results.json").read_text())
  assert res_results["history"] == ref_results["history"]
  assert res_results["checkpoints"]["resumed_from_step"] == killed_at
  # Every step is logged exactly once, and with the reference's values.
  ref_rows = [json.loads(l) for l in (reference / "metrics.jsonl").read_text().splitlines()]
  res_rows = [json.loads(l) for l in (resumed / "metrics.jsonl").read_text().splitlines()]
  train_rows = lambda rows: [(r["step"], r["loss"], r["cosine"]) for r in rows if "loss" in r]
  assert train_rows(res_rows) == train_rows(ref_rows)
  assert [r["step"] for r in res_rows if "loss" in r] == list(range(1, 41))


def test_deebert_resumes_at_and_after_its_stage_boundary(tiny_bert_dir, glue_dir, tmp_path):
  """DeeBERT's two stages: a crash right after the stage-1 end checkpoint and one inside
  stage 2 both resume to the uninterrupted run's parameters."""
  config = tiny_run_config(tiny_bert_dir, glue_dir,
                           "rte,multi_exit,objective=deebert,pooler_weights=per_exit,max_steps=6,"
                           "checkpoint_every=2",
                           learning_rate=1e-3)
  reference = train.train_and_evaluate(config, tmp_path / "reference")
  ref_params = run_dir.load_params(tmp_path / "reference")[0]
  # max_steps per stage: the final exit with the backbone, then the off-ramps.
  assert [h["stage"] for h in reference["history"]] == ["final_exit", "other_exits"]
  assert reference["train"]["steps"] == 12

  # One run crashes right after the stage-1 end checkpoint, resumes, crashes again inside
  # stage 2, and resumes to the end.
  workdir = tmp_path / "crashing"
  for crash_after in (6, 10):
    train_until_crash_after_save(config, workdir, crash_after)
  results = train.train_and_evaluate(config, workdir)
  assert results["checkpoints"]["resumed_from_step"] == 10
  assert results["history"] == reference["history"]
  params = run_dir.load_params(workdir)[0]
  assert jax.tree.all(jax.tree.map(np.array_equal, params, ref_params))


def test_a_workdir_with_another_config_is_refused_unless_overwrite(tiny_bert_dir, glue_dir,
                                                                    tmp_path):
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=ce,max_steps=2")
  train.train_and_evaluate(config, tmp_path / "run")
  other = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=ce,max_steps=2,seed=1")
  with pytest.raises(ValueError, match=r"another config \(seed: 0 -> 1\).*overwrite"):
    train.train_and_evaluate(other, tmp_path / "run")
  other.overwrite = True
  results = train.train_and_evaluate(other, tmp_path / "run")
  assert results["checkpoints"]["resumed_from_step"] is None
  # The first run's TensorBoard events went with its other outputs.
  assert len(list((tmp_path / "run" / run_dir.TENSORBOARD_DIR).glob("events.*"))) == 1
  saved = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
  assert saved["seed"] == 1


def test_an_unreadable_run_directory_gets_a_clear_error(tiny_bert_dir, glue_dir, tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text("{not json")
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,objective=ce,max_steps=2")
  with pytest.raises(ValueError, match=r"config\.json: unreadable run directory"):
    train.train_and_evaluate(config, workdir)
  (workdir / "config.json").unlink()
  (workdir / "checkpoints").mkdir()
  with pytest.raises(ValueError, match="checkpoints but no config.json"):
    train.train_and_evaluate(config, workdir)


def _checkpoint_files(directory) -> dict[str, bytes]:
  directory = pathlib.Path(directory)  # an epath.Path, which refuses rglob's `**`
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_diverging_run_stops_naming_step_and_term_and_keeps_its_last_good_checkpoint(
    tiny_bert_dir, glue_dir, tmp_path, monkeypatch):
  """Step 1 at lr 1e12 leaves finite (huge) parameters, saved; a later step's loss is NaN. The
  run stops there, and the step-1 checkpoint (read back as saved, before the bad step) is
  still the latest, byte for byte."""
  config = tiny_run_config(tiny_bert_dir, glue_dir,
                           "rte,objective=acl,max_steps=30,checkpoint_every=1",
                           learning_rate=1e12, warmup_ratio=0.0, max_grad_norm=1e30)
  saved = {}  # step -> the checkpoint's files, read once its save has finished
  original = run_dir.RunCheckpoints.save

  def save_and_read_back(self, step, state, progress):
    original(self, step, state, progress)
    self.wait()
    saved[step] = _checkpoint_files(self.directory / "latest" / str(step))
  monkeypatch.setattr(run_dir.RunCheckpoints, "save", save_and_read_back)
  with pytest.raises(FloatingPointError, match=r"step (\d+): the (loss|ce|aux|grad_norm) term "
                     r"is (nan|inf|-inf)") as info:
    train.train_and_evaluate(config, tmp_path / "run")
  monkeypatch.undo()
  bad_step = int(info.value.args[0].split()[1].rstrip(":"))
  assert saved and max(saved) < bad_step, (sorted(saved), bad_step)
  good_step = max(saved)
  run = run_dir.RunCheckpoints(tmp_path / "run", async_save=False)
  assert run.latest_step() == good_step
  run.close()
  assert _checkpoint_files(tmp_path / "run" / "checkpoints" / "latest" / str(good_step)) == (
      saved[good_step])
  params, step = run_dir.load_params(tmp_path / "run")
  assert step == good_step and run_dir.all_finite(params)


def test_a_json_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
  """A kill while eval_results.json (or early_exit.json) is being written must not leave part
  of it: its presence marks a run as done."""
  path = tmp_path / run_dir.EVAL_RESULTS_FILE
  run_dir.write_json(path, {"final": {"step": 1}})
  before = path.read_text()

  def killed_halfway(self, text, *args, **kwargs):
    with open(os.fspath(self), "w") as f:
      f.write(text[:len(text) // 2])
    raise KeyboardInterrupt  # the process dies with half the text written

  monkeypatch.setattr(type(epath.Path(path)), "write_text", killed_halfway)
  with pytest.raises(KeyboardInterrupt):
    run_dir.write_json(path, {"final": {"step": 2, "validation": {"accuracy": 0.5}}})
  assert path.read_text() == before and json.loads(before) == {"final": {"step": 1}}
  monkeypatch.undo()
  run_dir.write_json(path, {"final": {"step": 2}})  # the next write replaces it
  assert json.loads(path.read_text()) == {"final": {"step": 2}}
  assert [p.name for p in tmp_path.iterdir()] == [run_dir.EVAL_RESULTS_FILE]


def test_saving_a_non_finite_state_is_refused(tmp_path):
  run = run_dir.RunCheckpoints(tmp_path, async_save=False)
  state = {"params": {"w": np.array([1.0, np.nan], np.float32)}, "step": np.int32(3)}
  with pytest.raises(FloatingPointError, match="step 3: the train state holds NaN or inf"):
    run.save(3, state, {"step": 3})
  assert run.latest_step() is None
  run.close()


def test_there_are_records_under_the_old_field_names():
  old = [path for path in RECORDS
         if set(run_dir.RENAMED_FIELDS) & set(json.loads(path.read_text())["config"])]
  assert len(old) >= 80, f"{len(old)} of {len(RECORDS)}"  # the tests below read real ones


@pytest.mark.parametrize("path", RECORDS[::9], ids=lambda p: str(p.parent.relative_to(
    REPO_ROOT / "experiments/results/records")))
def test_a_committed_record_reads_in_todays_field_names(path):
  raw = json.loads(path.read_text())["config"]
  config = run_dir.read_config(path.parent)
  if config.objective == "deebert" and config.pooler_weights == "shared":
    # Recorded before DeeBERT's off-ramps got their own poolers: it loads (for sweeps and
    # export) but no longer trains, and says why.
    with pytest.raises(ValueError, match="pooler_weights=per_exit"):
      config_lib.validate(config)
  else:
    config_lib.validate(config)
  assert set(config) == set(config_lib.defaults(data.get_task(config.task)))
  for old, new in run_dir.RENAMED_FIELDS.items():
    if old in raw:
      assert config[new] == raw[old] and old not in config
  assert config.pooler_input == raw.get("exit_pooling", raw.get("pooler_input", "cls"))


def test_a_run_recorded_under_the_old_field_names_reloads_resumes_and_exports(tiny_bert_dir,
                                                                              glue_dir,
                                                                              tmp_path):
  """A run directory whose config.json says lambda, gate, pooler and no pooler_input (as the
  committed records do) loads, resumes under today's config and exports."""
  config = tiny_run_config(tiny_bert_dir, glue_dir, "rte,multi_exit,objective=acl_cl,"
                           "gate_granularity=global,pooler_weights=per_exit,aux_weight=0.3,"
                           "max_steps=2")
  workdir = tmp_path / "run"
  train.train_and_evaluate(config, workdir)
  path = workdir / run_dir.CONFIG_FILE
  saved = json.loads(path.read_text())
  new_to_old = {new: old for old, new in run_dir.RENAMED_FIELDS.items()}
  saved["config"] = {new_to_old.get(key, key): value for key, value in saved["config"].items()
                     if key != "pooler_input"}
  assert {"lambda", "gate", "pooler"} <= set(saved["config"])
  path.write_text(json.dumps(saved))

  run = run_dir.load_trained_run(workdir)
  assert run.config.aux_weight == 0.3 and run.config.gate_granularity == "global"
  assert run.model.pooler_weights == "per_exit" and run.model.pooler_input == "cls"
  resumed = train.train_and_evaluate(config, workdir)
  assert resumed["checkpoints"]["resumed_from_step"] == 2
  out = hf_weights.export_hf(run, tmp_path / "export")
  assert (out / "model.safetensors").exists() and (out / hf_weights.EXIT_HEADS_FILE).exists()
