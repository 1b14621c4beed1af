"""Command line: flags only.

    python -m acl_jax.main --config=configs/glue.py:rte --workdir=runs/rte
    python -m acl_jax.main --mode=early_exit --workdir=runs/rte_multi_exit
    python -m acl_jax.main --mode=export --workdir=runs/rte
    python -m acl_jax.main --mode=predict --workdir=runs/rte --submission_dir=runs/glue
"""

import logging as std_logging
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from acl_jax import config as config_lib
from acl_jax import early_exit
from acl_jax import host
from acl_jax import parallel
from acl_jax import preemption
from acl_jax import run_dir
from acl_jax import submission
from acl_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and preset string, e.g. configs/glue.py:rte,model=minilm.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (config, metrics, results).")
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "early_exit", "export", "predict"],
    "train: fine-tune (resumes from <workdir>/checkpoints when rerun; on SIGTERM or Ctrl-C "
    f"saves at the current step and exits with code {preemption.EXIT_CODE}); early_exit: "
    "sweep the exit policies of a trained multi-exit run, write early_exit.json and "
    "early_exit.png; "
    "export: write <workdir>/hf_export, an HF BertForSequenceClassification directory; "
    "predict: write the task's GLUE test-set predictions in the benchmark's format, one TSV "
    "per benchmark file (MNLI: MNLI-m, MNLI-mm and AX), into --submission_dir and zip that "
    "directory's TSVs into <submission_dir>.zip, the file to upload. early_exit, export and "
    f"predict stop at once on SIGTERM with exit code {preemption.EXIT_CODE}: rerun to redo them.")
_PARAMS = flags.DEFINE_enum("params", "latest", ["latest", "best"],
                            "early_exit, export, predict: the final (latest) or the best-dev "
                            "params.")
_SUBMISSION_DIR = flags.DEFINE_string(
    "submission_dir", None, "predict: where the TSVs go (default <workdir>/glue_submission); "
    "give one directory to the runs of every task to collect them into one zip.")
_EXIT_POLICY = flags.DEFINE_enum(
    "exit_policy", None, list(early_exit.POLICIES),
    "predict, multi-exit runs: exit where this policy says, at --exit_threshold (default: "
    "every example at the last exit). As in the early_exit sweep, pcee waits for 2 confident "
    "exits and STS-B takes patience only (moves below 0.1).")
_EXIT_THRESHOLD = flags.DEFINE_float(
    "exit_threshold", None, "predict: --exit_policy's threshold, as in early_exit.json: "
    "entropy in nats (entropy), consecutive unchanged exits (patience), normalized entropy "
    "in (0, 1] (pcee).")
_MAX_EXAMPLES = flags.DEFINE_integer(
    "max_examples", None, "early_exit: dev examples timed at batch size 1 (default: all).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "auto",
    "Persistent XLA compilation cache: a directory, 'none', or 'auto' ($JAX_COMPILATION_CACHE_DIR,"
    " else <$ACL_JAX_CACHE or ~/.cache/acl_jax>/xla/<CPU fingerprint>). Later runs of the same "
    "programs (a grid's seeds, a resumed run) load them instead of compiling.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Also print library log lines (orbax, absl) on the console; they always "
    "go to <workdir>/run.log.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  # INFO records reach <workdir>/run.log; the console shows warnings and errors only.
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().setLevel(std_logging.INFO if _VERBOSE.value else std_logging.WARNING)
  host.enable_compilation_cache(_COMPILATION_CACHE.value)  # config.json's meta names it
  if _MODE.value == "train":
    if _CONFIG.value is None:
      raise app.UsageError("--mode=train needs --config, e.g. --config=configs/glue.py:rte")
    config_lib.validate(_CONFIG.value)  # --config.<field> overrides, before loading anything
    parallel.initialize_distributed()  # multi-host: joins the job; else a no-op
    try:
      train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except preemption.Preempted:
      sys.exit(preemption.EXIT_CODE)  # the loop has saved and said so
    return
  # The run directory's config.json says what was trained; --config is not needed.
  with (run_dir.logging_to(run_dir.resolve(_WORKDIR.value)),
        preemption.exit_on_sigterm(f"--mode={_MODE.value}")):
    if _MODE.value == "early_exit":
      early_exit.run_on_workdir(_WORKDIR.value, which=_PARAMS.value,
                                max_examples=_MAX_EXAMPLES.value, log=print)
    elif _MODE.value == "export":
      run = run_dir.load_trained_run(_WORKDIR.value, which=_PARAMS.value)
      print(f"Wrote {run_dir.write_export(run)}")
    elif _MODE.value == "predict":
      if (_EXIT_POLICY.value is None) != (_EXIT_THRESHOLD.value is None):
        raise app.UsageError("--exit_policy and --exit_threshold go together")
      policy = (early_exit.Policy(_EXIT_POLICY.value, _EXIT_THRESHOLD.value)
                if _EXIT_POLICY.value else None)
      submission.run_on_workdir(_WORKDIR.value, which=_PARAMS.value,
                                submission_dir=_SUBMISSION_DIR.value, policy=policy, log=print)


def parse_flags(argv):
  """absl's flag parsing, after checking every --config.<field> names a field: an unknown one
  stops here with a message naming it, instead of an AttributeError traceback."""
  try:
    config_lib.check_overrides(argv[1:])
  except ValueError as e:
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
    sys.exit(1)
  return app.parse_flags_with_usage(argv)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
