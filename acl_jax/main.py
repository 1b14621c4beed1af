"""Command line: flags only.

    python -m acl_jax.main --config=configs/glue.py:rte --workdir=runs/rte
    python -m acl_jax.main --mode=early_exit --workdir=runs/rte_multi_exit
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from acl_jax import checkpoints
from acl_jax import early_exit
from acl_jax import parallel
from acl_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and preset string, e.g. configs/glue.py:rte,model=minilm.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (config, metrics, results).")
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "early_exit", "export"],
    "train: fine-tune (resumes from <workdir>/checkpoints when rerun); early_exit: sweep the "
    "exit policies of a trained multi-exit run, write early_exit.json and early_exit.png; "
    "export: write <workdir>/hf_export, an HF BertForSequenceClassification directory.")
_PARAMS = flags.DEFINE_enum("params", "latest", ["latest", "best"],
                            "early_exit, export: the final (latest) or the best-dev params.")
_MAX_EXAMPLES = flags.DEFINE_integer(
    "max_examples", None, "early_exit: dev examples timed at batch size 1 (default: all).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "auto",
    "Persistent XLA compilation cache: a directory, 'none', or 'auto' ($JAX_COMPILATION_CACHE_DIR,"
    " else <$ACL_JAX_CACHE or ~/.cache/acl_jax>/xla/<CPU fingerprint>). Later runs of the same "
    "programs (a grid's seeds, a resumed run) load them instead of compiling.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.INFO)
  cache = train.enable_compilation_cache(_COMPILATION_CACHE.value)
  logging.info("compilation cache: %s", cache or "off")
  if _MODE.value == "train":
    if _CONFIG.value is None:
      raise app.UsageError("--mode=train needs --config, e.g. --config=configs/glue.py:rte")
    parallel.initialize_distributed()  # multi-host: joins the job; else a no-op
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  elif _MODE.value == "early_exit":
    # The run directory's config.json says what was trained; --config is not needed.
    early_exit.run_on_workdir(_WORKDIR.value, which=_PARAMS.value,
                              max_examples=_MAX_EXAMPLES.value, log=logging.info)
  elif _MODE.value == "export":
    out = checkpoints.export_hf(train.load_trained_run(_WORKDIR.value, which=_PARAMS.value))
    logging.info("Wrote %s", out)


if __name__ == "__main__":
  app.run(main)
