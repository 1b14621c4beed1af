"""--mode=predict: GLUE test-set submissions, checked against the test files and against the
model's own outputs on them.

The runs are written as training leaves a run directory (config.json and a latest checkpoint,
through run_dir's own checkpoint code), from random params with rescaled classifier heads
(write_run), without paying for training, which other tests cover.
"""

import functools
import re
import subprocess
import sys
import zipfile

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from acl_jax import config as config_lib
from acl_jax import data
from acl_jax import early_exit
from acl_jax import hf_weights
from acl_jax import models
from acl_jax import run_dir
from acl_jax import submission
from conftest import REPO_ROOT, tiny_run_config

# write_run's heads scale up tiny differences between examples, and with them float32
# rounding, which differs between the submission's eval batches and model_logits' batches by
# up to ~1e-3: rows whose top two logits (or entropy and threshold) are closer than
# NEAR_TIE may fairly differ, and STS-B scores agree to SCORE_TOLERANCE (their spread is 10).
NEAR_TIE = 1e-2
SCORE_TOLERANCE = 1e-2
# write_run calibrates the heads on this many test examples; model_logits' batch size.
CALIBRATION_EXAMPLES = CHUNK = 256


@functools.partial(jax.jit, static_argnums=0)
def init_model(model, key):
  dummy = jnp.zeros((1, 8), jnp.int32)
  return model.init(key, dummy, dummy, dummy)["params"]


def run_config(tiny_bert_dir, glue_dir, preset: str):
  """tiny_run_config with one length bucket: one compiled forward per model."""
  config = tiny_run_config(tiny_bert_dir, glue_dir, preset)
  config.data.buckets = ()
  return config


def write_run(workdir, config, *, centre: float = 0.0, spread: float = 10.0):
  """A run directory holding random params whose classifier heads are rescaled so that, on the
  task's first test split, each logit has its median at `centre` and its 10th to 90th
  percentile `spread` apart: a random BERT's outputs barely vary from example to example, and
  the checks want every class predicted (STS-B scores on both sides of [0, 5]). Returns the
  run loaded back."""
  task = data.get_task(config.task)
  _, bert_config, tokenizer = hf_weights.load_backbone(config)
  model = models.from_config(config, bert_config, task.num_labels)
  params = jax.tree.map(np.asarray, flax.core.unfreeze(init_model(model, jax.random.key(0))))
  examples = data.load_split(task, next(iter(task.test_splits)), glue_dir=config.data.glue_dir)
  encoded = data.encode(examples, tokenizer, max_length=config.max_length, cache_dir=False)
  heads = ([params[f"exit_{layer}"]["classifier"] for layer in model.resolved_exit_layers()]
           if config.multi_exit else [params["classifier"]])
  calibration = model_logits(model, params, encoded, config.max_length, CALIBRATION_EXAMPLES)
  for head, logits in zip(heads, calibration):
    scale = spread / (np.percentile(logits, 90, axis=0) - np.percentile(logits, 10, axis=0))
    head["kernel"] = head["kernel"] * scale
    head["bias"] = (head["bias"] - np.median(logits, axis=0)) * scale + centre
  workdir.mkdir(parents=True)
  run_dir.write_json(workdir / run_dir.CONFIG_FILE, {"config": config.to_dict()})
  checkpoints = run_dir.RunCheckpoints(workdir, async_save=False)
  checkpoints.save(0, {"params": params}, {"step": 0})
  checkpoints.close()
  return run_dir.load_trained_run(workdir)


@functools.partial(jax.jit, static_argnums=0)
def apply_model(model, params, *inputs):
  return model.apply({"params": params}, *inputs)["logits"]


def model_logits(model, params, encoded, length: int, limit: int | None = None) -> np.ndarray:
  """Every exit's logits [E, N, K] on the first `limit` examples (default all), in batches
  of CHUNK padded to `length` (not the submission's eval batches: other shapes, other rows
  together)."""
  count = min(limit or len(encoded), len(encoded))
  indices = np.full(-(-count // CHUNK) * CHUNK, -1)  # -1: a padding row
  indices[:count] = np.arange(count)
  out = []
  for chunk in indices.reshape(-1, CHUNK):  # one shape: one compile per model
    batch = data.make_batch(encoded, chunk, length)
    logits = np.asarray(apply_model(model, params, *(batch[k] for k in data.MODEL_INPUTS)))
    out.append((logits if logits.ndim == 3 else logits[None])[:, chunk >= 0])
  return np.concatenate(out, axis=1)


def run_logits(run, encoded) -> np.ndarray:
  return model_logits(run.model, run.params, encoded, run.config.max_length)


def tsv_column(path, column: str) -> list[str]:
  lines = [line.rstrip("\r") for line in path.read_text(encoding="utf-8-sig").split("\n")]
  header = lines[0].split("\t")
  return [line.split("\t")[header.index(column)] for line in lines[1:] if line]


def clear_margin(logits: np.ndarray) -> np.ndarray:
  """Rows of [..., N, K] logits whose top two classes are not near a tie."""
  top = np.sort(logits, axis=-1)
  return top[..., -1] - top[..., -2] > NEAR_TIE


def check_file(path, test_file, task, expected_ids=None):
  """The submission file's header and ids against the test file; returns its predictions."""
  assert path.read_text().split("\n")[0] == "index\tprediction"
  ids = tsv_column(path, "index")
  assert ids == (expected_ids or tsv_column(test_file, "index"))
  predictions = tsv_column(path, "prediction")
  if not task.is_regression:
    assert set(predictions) == set(task.labels)  # every class predicted, by name
  return predictions


@pytest.fixture(scope="module")
def collected(tmp_path_factory, tiny_bert_dir, glue_dir):
  """RTE, CoLA (labels 0/1) and STS-B runs, all written into one submission directory. Two
  length buckets: the eval batches are not in the test file's order, so the files' order is
  checked."""
  root = tmp_path_factory.mktemp("predict")
  runs = {name: write_run(root / name, tiny_run_config(tiny_bert_dir, glue_dir, name),
                          centre=2.5 if name == "stsb" else 0.0)
          for name in ("rte", "cola", "stsb")}
  directory = root / "glue"
  for run in runs.values():
    submission.write_submission(run, directory)
  return runs, directory


@pytest.mark.parametrize("name,file", [("rte", "RTE.tsv"), ("cola", "CoLA.tsv"),
                                       ("stsb", "STS-B.tsv")])
def test_each_file_holds_the_models_predictions_on_the_test_file(collected, glue_dir, name,
                                                                 file):
  runs, directory = collected
  run = runs[name]
  task = run.task
  predictions = check_file(directory / file, glue_dir / task.glue_dir_name / "test.tsv", task)
  logits = run_logits(run, run.load_encoded("test"))[-1]
  if task.is_regression:
    raw = logits[:, 0]
    # Scores below 0, inside and above 5: the clipping is exercised both ways.
    assert (raw < 0).any() and (raw > 5).any() and ((raw > 0.5) & (raw < 4.5)).any()
    np.testing.assert_allclose(np.asarray(predictions, np.float64), np.clip(raw, 0, 5),
                               atol=SCORE_TOLERANCE)
  else:
    expected = np.asarray(task.labels)[logits.argmax(-1)]
    clear = clear_margin(logits)
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(np.asarray(predictions)[clear], expected[clear])


def test_the_zip_holds_every_collected_file_at_its_top_level(collected):
  runs, directory = collected
  with zipfile.ZipFile(directory.parent / "glue.zip") as archive:
    members = {name: archive.read(name) for name in archive.namelist()}
  assert sorted(members) == ["CoLA.tsv", "RTE.tsv", "STS-B.tsv"]
  for name, content in members.items():
    assert content == (directory / name).read_bytes()
  sources = run_dir.read_json(directory / submission.SOURCES_FILE)
  assert {name: sources[name]["workdir"] for name in members} == {
      "RTE.tsv": str(runs["rte"].workdir), "CoLA.tsv": str(runs["cola"].workdir),
      "STS-B.tsv": str(runs["stsb"].workdir)}


def test_an_exit_policy_needs_a_multi_exit_run(collected, tmp_path):
  runs, _ = collected
  with pytest.raises(ValueError, match="single-exit run"):
    submission.write_submission(runs["rte"], tmp_path / "out",
                                policy=early_exit.Policy("entropy", 0.3))


def test_cli_predicts_a_multi_exit_run_at_the_policys_exits(tiny_bert_dir, glue_dir, tmp_path):
  config = run_config(tiny_bert_dir, glue_dir, "wnli,multi_exit")
  run = write_run(tmp_path / "run", config, spread=4.0)
  logits = run_logits(run, run.load_encoded("test"))  # [2 exits, 146, 2]
  # The median entropy at the first exit: about half the examples leave there.
  threshold = float(np.round(np.median(early_exit.entropy(logits[0])), 4))
  proc = subprocess.run(
      [sys.executable, "-m", "acl_jax.main", "--mode=predict", f"--workdir={run.workdir}",
       "--exit_policy=entropy", f"--exit_threshold={threshold}", "--compilation_cache=none"],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  path = run.workdir / run_dir.SUBMISSION_DIR / "WNLI.tsv"
  assert str(path) in proc.stdout
  predictions = check_file(path, glue_dir / "WNLI" / "test.tsv", run.task)

  chosen, expected = early_exit.counted_exits(early_exit.Policy("entropy", threshold),
                                              jnp.asarray(logits))
  expected = np.asarray(run.task.labels)[np.asarray(expected)]
  clear = (clear_margin(logits).all(0)
           & (np.abs(np.asarray(early_exit.entropy(logits)) - threshold) > NEAR_TIE).all(0))
  assert clear.mean() > 0.8
  np.testing.assert_array_equal(np.asarray(predictions)[clear], expected[clear])
  # The policy made a difference: some rows exit early with another answer than the last exit.
  last = np.asarray(run.task.labels)[logits[-1].argmax(-1)]
  assert (np.asarray(predictions) != last).any()

  sources = run_dir.read_json(run.workdir / run_dir.SUBMISSION_DIR / submission.SOURCES_FILE)
  assert sources["WNLI.tsv"]["policy"]["name"] == "entropy"
  # Exits 1 and 2: both taken, as often as counted here (give or take a near tie).
  assert 1 < sources["WNLI.tsv"]["mean_layers"] < 2
  assert sources["WNLI.tsv"]["mean_layers"] == pytest.approx(1 + np.asarray(chosen).mean(),
                                                             abs=0.03)
  with zipfile.ZipFile(run.workdir / run_dir.SUBMISSION_ZIP) as archive:
    assert archive.namelist() == ["WNLI.tsv"]
    assert archive.read("WNLI.tsv") == path.read_bytes()


def write_tsv(path, header, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join("\t".join(row) for row in [header, *rows]) + "\n")


def test_mnli_writes_matched_mismatched_and_the_diagnostic_set(tiny_bert_dir, tmp_path):
  """On a small GLUE directory written here (MNLI and AX are not in the offline data); ids that
  are not row numbers show they come from the test files' index column."""
  glue = tmp_path / "glue"
  pairs = [("A man eats.", "Someone eats."), ("A dog runs.", "A cat sleeps."),
           ("It rains.", "The ground is wet."), ("She sings.", "Nobody sings.")]
  ids = {"test_matched.tsv": ["7", "3", "12", "0"], "test_mismatched.tsv": ["1", "5", "2", "9"]}
  for name, file_ids in ids.items():
    write_tsv(glue / "MNLI" / name, ["index", "sentence1", "sentence2"],
              [(i, *pair) for i, pair in zip(file_ids, pairs)])
  write_tsv(glue / "diagnostic" / "diagnostic.tsv", ["index", "sentence1", "sentence2"],
            [(str(i), *pair) for i, pair in enumerate(pairs[:3])])
  run = write_run(tmp_path / "run", run_config(tiny_bert_dir, glue, "mnli"))
  directory = tmp_path / "out"
  written = submission.write_submission(run, directory)
  assert [p.name for p in written] == ["MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv"]
  tests = {"MNLI-m.tsv": (data.get_task("mnli"), "test_matched"),
           "MNLI-mm.tsv": (data.get_task("mnli"), "test_mismatched"),
           "AX.tsv": (data.DIAGNOSTIC, "test")}
  for name, (task, split) in tests.items():
    test_file = glue / task.glue_dir_name / f"{task.test_splits[split]}.tsv"
    ids = tsv_column(directory / name, "index")
    assert ids == tsv_column(test_file, "index")
    logits = run_logits(run, run.encode(run.load_examples(split, task)))[-1]
    assert clear_margin(logits).all()
    assert tsv_column(directory / name, "prediction") == [
        task.labels[i] for i in logits.argmax(-1)]
  with zipfile.ZipFile(tmp_path / "out.zip") as archive:
    assert sorted(archive.namelist()) == ["AX.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"]

  # AX is written when present; a missing MNLI test file is an error naming it.
  (glue / "diagnostic" / "diagnostic.tsv").unlink()
  written = submission.write_submission(run, tmp_path / "no_ax", log=lambda line: None)
  assert [p.name for p in written] == ["MNLI-m.tsv", "MNLI-mm.tsv"]
  missing = glue / "MNLI" / "test_mismatched.tsv"
  missing.unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
    submission.write_submission(run, tmp_path / "missing", log=lambda line: None)


def test_overwriting_a_run_deletes_its_submission(tmp_path):
  """Predictions of params that no longer exist must not survive a retraining."""
  config = config_lib.get_config("rte")
  config.overwrite = True
  (tmp_path / run_dir.SUBMISSION_DIR).mkdir()
  (tmp_path / run_dir.SUBMISSION_DIR / "RTE.tsv").write_text("index\tprediction\n")
  (tmp_path / run_dir.SUBMISSION_ZIP).write_bytes(b"")
  run_dir.prepare_workdir(tmp_path, config)
  assert not (tmp_path / run_dir.SUBMISSION_DIR).exists()
  assert not (tmp_path / run_dir.SUBMISSION_ZIP).exists()
