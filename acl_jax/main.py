"""Command line: flags only.

    python -m acl_jax.main --config=configs/glue.py:rte --workdir=runs/rte
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from acl_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file and preset string, e.g. configs/glue.py:rte,model=minilm.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (config, metrics, results).")
_MODE = flags.DEFINE_enum("mode", "train", ["train"], "What to do with the run directory.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.INFO)
  if _MODE.value == "train":
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
