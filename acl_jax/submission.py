"""GLUE test-set submissions: a trained run's test predictions in the benchmark's upload format.

    <dir>/<file>.tsv    one per file of the benchmark (CoLA.tsv, MNLI-m.tsv, AX.tsv, ...):
                        columns `index` (the test file's) and `prediction`, tab-separated, with
                        a header row; a label as written in the GLUE train files (entailment,
                        0, ...) or an STS-B score clipped to [0, 5]
    <dir>/sources.json  for each file, the run, params, checkpoint step and exit policy that
                        wrote it
    <dir>.zip           every benchmark TSV in <dir>, at the zip's top level: the file to
                        upload

Several runs (one per task) may write into one directory: each replaces its own files and
rewrites the zip with all of them. A multi-exit run predicts at the exit an early-exit policy
chooses (counted mode: one full forward, then early_exit.counted_exits), by default the last.
"""

import io
import zipfile
from typing import Callable, Sequence

from etils import epath
import numpy as np

from acl_jax import data
from acl_jax import early_exit
from acl_jax import run_dir
from acl_jax.models import multi_exit

SOURCES_FILE = "sources.json"
STSB_RANGE = (0.0, 5.0)  # the benchmark scores STS-B predictions on this scale
# The benchmark's file names where they are not the task's GLUE directory name.
_FILE_STEMS = {("mnli", "test_matched"): "MNLI-m", ("mnli", "test_mismatched"): "MNLI-mm",
               (data.DIAGNOSTIC.name, "test"): "AX"}
# Fixed member timestamps: the same predictions give the same zip, byte for byte.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def files_of(task: data.TaskSpec) -> list[tuple[data.TaskSpec, str, str]]:
  """(task, test split, file name) of every file a run of `task` writes; an MNLI run also
  predicts the diagnostic set AX."""
  tasks = (task, data.DIAGNOSTIC) if task.name == "mnli" else (task,)
  return [(t, split, _FILE_STEMS.get((t.name, split), t.glue_dir_name) + ".tsv")
          for t in tasks for split in t.test_splits]


def benchmark_files() -> list[str]:
  """Every file name of a complete submission: what the zip may hold, so nothing else a user
  keeps in the directory goes in."""
  return [name for task in data.TASKS.values() for _, _, name in files_of(task)]


def check_policy(run: run_dir.TrainedRun, policy: early_exit.Policy | None) -> None:
  if policy is None:
    return
  if not isinstance(run.model, multi_exit.MultiExitBert):
    raise ValueError(f"{run.workdir} is a single-exit run; an exit policy needs a multi-exit "
                     "one (trained with the `multi_exit` preset)")
  if run.task.is_regression and policy.name not in early_exit.REGRESSION_POLICIES:
    raise ValueError(f"the {policy.name} policy does not apply to {run.task.name}; valid: "
                     f"{', '.join(early_exit.REGRESSION_POLICIES)}")


def predict(run: run_dir.TrainedRun, encoded: data.Encoded,
            policy: early_exit.Policy | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(prediction [N], exit index [N]) of every example, in the split's order: class ids or
  raw STS-B scores. A multi-exit run exits where `policy` says (None: at the last exit); a
  single-exit run has one exit, index 0."""
  check_policy(run, policy)
  regression = run.task.is_regression
  logits, order = early_exit.exit_logits(run, encoded)
  real = order >= 0  # eval batches pad with masked rows
  logits, order = logits[:, real], order[real]
  if policy is None:
    chosen = np.full(len(order), len(logits) - 1)
    preds = early_exit.prediction(logits[-1], regression)
  else:
    chosen, preds = early_exit.counted_exits(policy, logits, regression=regression)
  by_example = np.argsort(order)
  return np.asarray(preds)[by_example], np.asarray(chosen)[by_example]


def prediction_strings(task: data.TaskSpec, predictions: np.ndarray) -> list[str]:
  """Predictions as the benchmark reads them: label names, or STS-B scores clipped to
  [0, 5]."""
  if task.is_regression:
    return [f"{score:.6f}" for score in np.clip(predictions, *STSB_RANGE)]
  return [task.labels[i] for i in predictions]


def tsv_text(ids: Sequence[str], predictions: Sequence[str]) -> str:
  if len(ids) != len(predictions):
    raise ValueError(f"{len(ids)} ids but {len(predictions)} predictions")
  return "index\tprediction\n" + "".join(f"{i}\t{p}\n" for i, p in zip(ids, predictions))


def zip_bytes(files: dict[str, bytes]) -> bytes:
  """A zip of name -> content, built in memory (written with one path.write_bytes, which
  works for any path type the workdir may have)."""
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
    for name in sorted(files):
      archive.writestr(zipfile.ZipInfo(name, _ZIP_DATE), files[name],
                       compress_type=zipfile.ZIP_DEFLATED)
  return buffer.getvalue()


def zip_path(directory: epath.Path) -> epath.Path:
  return directory.parent / f"{directory.name}.zip"


def write_submission(run: run_dir.TrainedRun, directory: epath.PathLike, *,
                     policy: early_exit.Policy | None = None, params: str = "latest",
                     log: Callable[[str], None] = print) -> list[epath.Path]:
  """Writes the run's test-set files into `directory` and rewrites <directory>.zip with every
  TSV there. Returns the files written. A missing test file raises FileNotFoundError naming
  it; only the diagnostic set (AX) is skipped when absent."""
  check_policy(run, policy)  # before writing anything
  directory = epath.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  sources_path = directory / SOURCES_FILE
  sources = run_dir.read_json(sources_path) if sources_path.exists() else {}
  exit_layers = (run.model.resolved_exit_layers()
                 if isinstance(run.model, multi_exit.MultiExitBert)
                 else (run.model.config.num_hidden_layers,))
  written = []
  for task, split, name in files_of(run.task):
    try:
      examples = run.load_examples(split, task)
    except FileNotFoundError as e:
      if task is not data.DIAGNOSTIC:
        raise
      log(f"Skipping AX (the diagnostic set): {e}")
      continue
    predictions, chosen = predict(run, run.encode(examples), policy)
    path = directory / name
    path.write_text(tsv_text(examples.ids, prediction_strings(task, predictions)))
    layers = np.asarray(exit_layers)[chosen]
    sources[name] = {
        "workdir": str(run.workdir), "task": run.task.name, "source": examples.source,
        "examples": len(examples), "params": params, "checkpoint_step": run.step,
        "policy": None if policy is None else {"name": policy.name,
                                               "threshold": policy.threshold,
                                               "patience": policy.patience,
                                               "tolerance": policy.tolerance},
        **early_exit.speedup(layers, run.model.config.num_hidden_layers)}
    written.append(path)
    log(f"Wrote {path} ({len(examples)} predictions, mean exit layer "
        f"{sources[name]['mean_layers']:.2f})")
  run_dir.write_json(sources_path, sources)
  archive = zip_path(directory)
  members = {name: (directory / name).read_bytes() for name in benchmark_files()
             if (directory / name).exists()}
  archive.write_bytes(zip_bytes(members))
  log(f"Wrote {archive}: {', '.join(sorted(members))}")
  return written


def run_on_workdir(workdir, *, which: str = "latest", submission_dir=None,
                   policy: early_exit.Policy | None = None,
                   log: Callable[[str], None] = print) -> list[epath.Path]:
  """--mode=predict: the run's `which` params (latest | best) predict its task's test sets
  into submission_dir (default <workdir>/glue_submission) and <submission_dir>.zip."""
  run = run_dir.load_trained_run(workdir, which=which)
  directory = (run_dir.resolve(submission_dir) if submission_dir
               else run.workdir / run_dir.SUBMISSION_DIR)
  return write_submission(run, directory, policy=policy, params=which, log=log)
