"""GLUE input pipeline: task registry, loading, tokenization with a cache, padded batches.

Data comes from the original GLUE TSV layout (`<GLUE_DIR>/<TASK>/{train,dev,test}.tsv`, read
with the `datasets` "csv" builder, quoting disabled) or from the hub (`nyu-mll/glue`) when no
GLUE directory is given. Batches are NumPy dicts of fixed shape per length bucket, padded with
masked rows, so a compiled step sees at most one shape per bucket and eval sums stay exact.

NumPy only: JAX runs inside compiled steps, never here.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import pathlib
import tempfile
from typing import Iterator, Sequence

import numpy as np

HUB_DATASET = "nyu-mll/glue"
# Bump when the cached arrays change meaning, so old files are never read back.
_CACHE_FORMAT = 1
# Large enough for the fast tokenizer's Rust batch parallelism, small enough to bound memory.
_TOKENIZE_CHUNK = 4096
# The batch keys a model reads, in the order of its positional arguments.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# The column of every GLUE test file that names its rows.
TEST_ID_COLUMN = "index"

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """What the pipeline and the metrics need to know about one GLUE task.

  `labels` are the label strings as written in the TSV files, in the order of the hub
  dataset's ClassLabel, so a class id means the same thing for both sources.
  `eval_splits` and `test_splits` map hub split names to TSV file stems.
  """
  name: str
  glue_dir_name: str
  hub_config: str
  text_columns: tuple[str, ...]
  label_column: str
  hub_text_columns: tuple[str, ...]
  labels: tuple[str, ...] | None
  metrics: tuple[str, ...]
  main_metric: str
  eval_splits: dict[str, str] = dataclasses.field(
      default_factory=lambda: {"validation": "dev"}, hash=False)
  test_splits: dict[str, str] = dataclasses.field(
      default_factory=lambda: {"test": "test"}, hash=False)
  # Column names for train/eval files that have no header row (CoLA). GLUE test files always
  # carry a header.
  tsv_column_names: tuple[str, ...] | None = None

  @property
  def is_regression(self) -> bool:
    return self.labels is None

  @property
  def num_labels(self) -> int:
    return 1 if self.labels is None else len(self.labels)

  @property
  def is_pair(self) -> bool:
    return len(self.text_columns) == 2

  @property
  def splits(self) -> tuple[str, ...]:
    return ("train", *self.eval_splits, *self.test_splits)


def _task(name, glue_dir_name, hub_config, text_columns, label_column, hub_text_columns,
          labels, metrics=("accuracy",), **kwargs) -> TaskSpec:
  return TaskSpec(name=name, glue_dir_name=glue_dir_name, hub_config=hub_config,
                  text_columns=text_columns, label_column=label_column,
                  hub_text_columns=hub_text_columns, labels=labels, metrics=metrics,
                  main_metric=metrics[0], **kwargs)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    _task("cola", "CoLA", "cola", ("sentence",), "label", ("sentence",), ("0", "1"),
          metrics=("mcc",),
          tsv_column_names=("source", "label", "label_notes", "sentence")),
    _task("sst2", "SST-2", "sst2", ("sentence",), "label", ("sentence",), ("0", "1")),
    _task("mrpc", "MRPC", "mrpc", ("#1 String", "#2 String"), "Quality",
          ("sentence1", "sentence2"), ("0", "1"), metrics=("f1", "accuracy")),
    _task("stsb", "STS-B", "stsb", ("sentence1", "sentence2"), "score",
          ("sentence1", "sentence2"), None, metrics=("pearson", "spearman")),
    _task("qqp", "QQP", "qqp", ("question1", "question2"), "is_duplicate",
          ("question1", "question2"), ("0", "1"), metrics=("f1", "accuracy")),
    _task("mnli", "MNLI", "mnli", ("sentence1", "sentence2"), "gold_label",
          ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
          eval_splits={"validation_matched": "dev_matched",
                       "validation_mismatched": "dev_mismatched"},
          test_splits={"test_matched": "test_matched", "test_mismatched": "test_mismatched"}),
    _task("qnli", "QNLI", "qnli", ("question", "sentence"), "label", ("question", "sentence"),
          ("entailment", "not_entailment")),
    _task("rte", "RTE", "rte", ("sentence1", "sentence2"), "label", ("sentence1", "sentence2"),
          ("entailment", "not_entailment")),
    _task("wnli", "WNLI", "wnli", ("sentence1", "sentence2"), "label",
          ("sentence1", "sentence2"), ("0", "1")),
)}
# GLUE's diagnostic set (AX): a test-only MNLI-style set, predicted by an MNLI model. Not in
# TASKS, as nothing trains on it.
DIAGNOSTIC = dataclasses.replace(
    TASKS["mnli"], name="ax", glue_dir_name="diagnostic", hub_config="ax", eval_splits={},
    test_splits={"test": "diagnostic"})


def get_task(name: str | TaskSpec) -> TaskSpec:
  """The task spec by name, case-insensitive; "SST-2", "sts_b" and "CoLA" all work."""
  if isinstance(name, TaskSpec):
    return name
  key = name.strip().lower().replace("-", "").replace("_", "")
  if key not in TASKS:
    raise ValueError(f"Unknown GLUE task {name!r}; valid tasks: {', '.join(TASKS)}")
  return TASKS[key]


def resolve_glue_dir(glue_dir: str | os.PathLike | None) -> pathlib.Path | None:
  """The GLUE TSV root: the argument, else $GLUE_DIR, else None (load from the hub)."""
  if glue_dir:
    return pathlib.Path(glue_dir).expanduser()
  env = os.environ.get("GLUE_DIR")
  return pathlib.Path(env).expanduser() if env else None


@dataclasses.dataclass(frozen=True, eq=False)
class Examples:
  """One split as raw text. labels: int32 class ids, float32 STS-B scores, None for test.

  line_numbers holds each row's 1-based line in the TSV file (1-based row position for the
  hub) so errors and predictions can point back at the source. ids: a test split's `index`
  column (the hub's `idx`), by which a GLUE submission names each prediction; None otherwise.
  """
  text_a: list[str]
  text_b: list[str] | None
  labels: np.ndarray | None
  source: str
  line_numbers: np.ndarray
  task: str = ""
  split: str = ""
  ids: list[str] | None = None

  def __len__(self) -> int:
    return len(self.text_a)


def _split_stem(task: TaskSpec, split: str) -> str:
  stems = {"train": "train", **task.eval_splits, **task.test_splits}
  if split not in stems:
    raise ValueError(f"Unknown split {split!r} for {task.name}; valid splits: "
                     f"{', '.join(stems)}")
  return stems[split]


def load_split(task: str | TaskSpec, split: str, *,
               glue_dir: str | os.PathLike | None = None) -> Examples:
  """Loads one split of a GLUE task from the TSV layout (glue_dir or $GLUE_DIR) or the hub.

  split is "train", one of task.eval_splits (e.g. "validation") or task.test_splits; test
  splits come back without labels: GLUE test labels are private and must never be scored.
  """
  task = get_task(task)
  stem = _split_stem(task, split)
  root = resolve_glue_dir(glue_dir)
  if root is None:
    return _load_hub(task, split)
  path = root / task.glue_dir_name / f"{stem}.tsv"
  if not path.is_file():
    raise FileNotFoundError(
        f"{path} not found. Expected the original GLUE layout "
        f"<GLUE_DIR>/{task.glue_dir_name}/{stem}.tsv with GLUE_DIR={root} (from the glue_dir "
        f"argument or the GLUE_DIR environment variable); set neither to load "
        f"{HUB_DATASET!r} from the hub instead.")
  return _load_tsv(task, split, path, labeled=split not in task.test_splits)


def _scan_tsv(path: pathlib.Path, column_names: Sequence[str] | None
              ) -> tuple[list[str], np.ndarray]:
  """Checks every line's field count; returns the column names and each data row's line.

  pandas reports too many fields but silently pads too few, and its messages do not name
  the file; checking here gives one clear error for both. Lines end at \\n, \\r\\n or a lone
  \\r and empty lines are skipped, as in pandas' C parser, so the row count must agree.
  """
  data = path.read_bytes()
  offset = 3 if data.startswith(b"\xef\xbb\xbf") else 0
  buf = np.frombuffer(data, np.uint8)[offset:]
  next_byte = np.append(buf[1:], np.uint8(0))
  ends = np.flatnonzero((buf == 10) | ((buf == 13) & (next_byte != 10)))
  if len(buf) and (not len(ends) or ends[-1] != len(buf) - 1):
    ends = np.append(ends, len(buf))
  starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
  crlf = (buf[np.maximum(ends - 1, 0)] == 13) & (buf[np.minimum(ends, len(buf) - 1)] == 10)
  stops = ends - ((ends > starts) & crlf)
  line_numbers = np.arange(1, len(starts) + 1)

  try:
    data[offset:].decode("utf-8")
  except UnicodeDecodeError as e:
    line = int(np.searchsorted(ends, e.start)) + 1
    raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None

  nonblank = stops > starts
  starts, stops, line_numbers = starts[nonblank], stops[nonblank], line_numbers[nonblank]
  if column_names is None:
    if not len(starts):
      raise ValueError(f"{path}: empty file, expected a header row")
    header_bytes = buf[starts[0]:stops[0]].tobytes()
    column_names = header_bytes.decode("utf-8").split("\t")
    starts, stops, line_numbers = starts[1:], stops[1:], line_numbers[1:]
  column_names = list(column_names)
  if len(set(column_names)) != len(column_names):
    raise ValueError(f"{path}: duplicate column names in header {column_names}")

  tabs = np.flatnonzero(buf == 9)
  tabs_per_line = (np.searchsorted(tabs, stops) - np.searchsorted(tabs, starts))
  bad = np.flatnonzero(tabs_per_line + 1 != len(column_names))
  if len(bad):
    i = bad[0]
    raise ValueError(
        f"{path}:{line_numbers[i]}: expected {len(column_names)} tab-separated fields "
        f"({', '.join(column_names)}), found {tabs_per_line[i] + 1}")
  return column_names, line_numbers


def _load_tsv(task: TaskSpec, split: str, path: pathlib.Path, *, labeled: bool) -> Examples:
  import datasets  # Deferred: importing it takes a second and most callers never load text.

  explicit = task.tsv_column_names if split not in task.test_splits else None
  columns, line_numbers = _scan_tsv(path, explicit)
  if not len(line_numbers):
    raise ValueError(f"{path}: no examples{' below its header' if explicit is None else ''}; "
                     f"the {task.name} {split} split needs at least one row")
  wanted = list(task.text_columns) + ([task.label_column] if labeled else [TEST_ID_COLUMN])
  missing = [c for c in wanted if c not in columns]
  if missing:
    raise ValueError(f"{path}: missing column(s) {missing}; the file has {columns}")

  # Every value stays a string: "null", "NA" and "nan" are text here, not missing values.
  ds = datasets.load_dataset(
      "csv", data_files={"rows": str(path)}, split="rows", delimiter="\t",
      quoting=csv.QUOTE_NONE, column_names=columns, header=None if explicit else 0,
      usecols=wanted, features=datasets.Features({c: datasets.Value("string") for c in wanted}),
      keep_default_na=False, na_filter=False, encoding="utf-8-sig")
  table = ds.with_format("arrow")[:]
  if table.num_rows != len(line_numbers):
    raise ValueError(f"{path}: parsed {table.num_rows} rows but the file has "
                     f"{len(line_numbers)} data lines")

  texts = [table.column(c).to_pylist() for c in task.text_columns]
  labels, ids = None, None
  if labeled:
    raw = table.column(task.label_column).to_pylist()
    labels = _parse_labels(task, raw, lambda i: f"{path}:{line_numbers[i]}")
  else:
    ids = table.column(TEST_ID_COLUMN).to_pylist()
  return Examples(text_a=texts[0], text_b=texts[1] if len(texts) > 1 else None, labels=labels,
                  source=str(path), line_numbers=line_numbers, task=task.name, split=split,
                  ids=ids)


def _parse_labels(task: TaskSpec, raw: list[str], where) -> np.ndarray:
  if task.labels is None:
    scores = np.empty(len(raw), np.float32)
    for i, value in enumerate(raw):
      try:
        scores[i] = float(value)
      except ValueError:
        scores[i] = np.nan
      if not math.isfinite(scores[i]):
        raise ValueError(f"{where(i)}: {task.name} score {value!r} is not a finite number")
    return scores
  ids = {label: i for i, label in enumerate(task.labels)}
  out = np.fromiter((ids.get(value, -1) for value in raw), np.int32, count=len(raw))
  bad = np.flatnonzero(out < 0)
  if len(bad):
    i = bad[0]
    raise ValueError(f"{where(i)}: unknown {task.name} label {raw[i]!r}; valid labels: "
                     f"{', '.join(repr(label) for label in task.labels)}")
  return out


def _load_hub(task: TaskSpec, split: str) -> Examples:
  import datasets

  ds = datasets.load_dataset(HUB_DATASET, task.hub_config, split=split)
  table = ds.with_format("arrow")[:]
  texts = [table.column(c).to_pylist() for c in task.hub_text_columns]
  source = f"{HUB_DATASET}/{task.hub_config}/{split}"
  labels, ids = None, None
  if split not in task.test_splits:
    dtype = np.float32 if task.is_regression else np.int32
    labels = np.asarray(table.column("label").to_numpy(), dtype)
    if not task.is_regression:
      bad = np.flatnonzero((labels < 0) | (labels >= task.num_labels))
      if len(bad):
        raise ValueError(f"{source} row {bad[0] + 1}: label id {labels[bad[0]]} outside "
                         f"[0, {task.num_labels})")
  else:
    ids = [str(i) for i in table.column("idx").to_pylist()]
  return Examples(text_a=texts[0], text_b=texts[1] if len(texts) > 1 else None, labels=labels,
                  source=source, line_numbers=np.arange(1, len(texts[0]) + 1), task=task.name,
                  split=split, ids=ids)


@dataclasses.dataclass(frozen=True, eq=False)
class Encoded:
  """Tokenized examples as flat ragged arrays: example i is input_ids[offsets[i]:offsets[i+1]].

  No padding is stored; batches pad to their bucket length with pad_id.
  """
  input_ids: np.ndarray  # int32 [sum(lengths)]
  token_type_ids: np.ndarray  # int32 [sum(lengths)]
  offsets: np.ndarray  # int64 [N + 1]
  lengths: np.ndarray  # int32 [N]
  labels: np.ndarray | None  # int32 or float32 [N]; None for test splits
  pad_id: int = 0

  def __len__(self) -> int:
    return len(self.lengths)

  def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, token_type_ids) of example i, unpadded."""
    lo, hi = self.offsets[i], self.offsets[i + 1]
    return self.input_ids[lo:hi], self.token_type_ids[lo:hi]


def _tokenizer_fingerprint(tokenizer) -> str:
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is not None:
    state = json.loads(backend.to_str())
    # Each call rewrites the backend's truncation/padding settings; they are call arguments
    # (max_length is in the key) and would otherwise make the fingerprint change after use.
    state.pop("truncation", None)
    state.pop("padding", None)
    h.update(json.dumps(state, sort_keys=True).encode())
  else:
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "init_kwargs", {}), sort_keys=True,
                        default=str).encode())
  h.update(repr((type(tokenizer).__name__, tokenizer.cls_token_id, tokenizer.sep_token_id,
                 tokenizer.pad_token_id, getattr(tokenizer, "truncation_side", None))).encode())
  return h.hexdigest()


def _cache_key(examples: Examples, tokenizer, max_length: int) -> str:
  # Hashing the text itself (not the path or mtime) makes the key right for hub data, copied
  # files and edited files alike; it costs milliseconds even for SST-2.
  h = hashlib.sha256()
  h.update(json.dumps([_CACHE_FORMAT, examples.split, int(max_length)]).encode())
  h.update(json.dumps(examples.text_a).encode())
  h.update(json.dumps(examples.text_b).encode())
  h.update(_tokenizer_fingerprint(tokenizer).encode())
  return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | bool | None = None) -> pathlib.Path | None:
  """Where acl_jax caches (tokenized splits, compiled programs): cache_dir, else
  $ACL_JAX_CACHE, else ~/.cache/acl_jax; False = no cache."""
  if cache_dir is False:
    return None
  if cache_dir is None or cache_dir is True:
    cache_dir = os.environ.get("ACL_JAX_CACHE") or "~/.cache/acl_jax"
  return pathlib.Path(cache_dir).expanduser()


def _tokenize(examples: Examples, tokenizer, max_length: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  ids_chunks, types_chunks, length_chunks = [], [], []
  for lo in range(0, len(examples), _TOKENIZE_CHUNK):
    hi = lo + _TOKENIZE_CHUNK
    b = examples.text_b[lo:hi] if examples.text_b is not None else None
    out = tokenizer(examples.text_a[lo:hi], b, truncation="longest_first",
                    max_length=max_length, padding=False, add_special_tokens=True,
                    return_token_type_ids=True, return_attention_mask=False)
    ids, types = out["input_ids"], out["token_type_ids"]
    lengths = np.fromiter(map(len, ids), np.int32, count=len(ids))
    total = int(lengths.sum())
    ids_chunks.append(np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=total))
    types_chunks.append(np.fromiter(itertools.chain.from_iterable(types), np.int32,
                                    count=total))
    length_chunks.append(lengths)
  cat = lambda chunks: np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
  return cat(ids_chunks), cat(types_chunks), cat(length_chunks)


def encode(examples: Examples, tokenizer, *, max_length: int,
           cache_dir: str | os.PathLike | bool | None = None) -> Encoded:
  """Tokenizes pairs with longest_first truncation and special tokens, without padding.

  Results are cached as .npz under cache_dir (default $ACL_JAX_CACHE or ~/.cache/acl_jax),
  keyed by the texts, the split, the tokenizer's vocabulary and settings, and max_length;
  cache_dir=False disables the cache.
  """
  root = cache_root(cache_dir)
  path = None
  if root is not None:
    key = _cache_key(examples, tokenizer, max_length)
    name = f"{examples.task or 'data'}-{examples.split or 'split'}-{max_length}-{key[:20]}"
    path = root / f"{name}.npz"
    cached = _read_cache(path, len(examples))
    if cached is not None:
      ids, types, lengths = cached
      return _make_encoded(ids, types, lengths, examples.labels, tokenizer)

  ids, types, lengths = _tokenize(examples, tokenizer, max_length)
  if path is not None:
    _write_cache(path, input_ids=ids, token_type_ids=types, lengths=lengths)
  return _make_encoded(ids, types, lengths, examples.labels, tokenizer)


def _make_encoded(ids, types, lengths, labels, tokenizer) -> Encoded:
  offsets = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  pad_id = tokenizer.pad_token_id
  return Encoded(input_ids=ids, token_type_ids=types, offsets=offsets, lengths=lengths,
                 labels=labels, pad_id=0 if pad_id is None else int(pad_id))


def _read_cache(path: pathlib.Path, num_examples: int):
  if not path.is_file():
    return None
  try:
    with np.load(path) as f:
      ids, types, lengths = f["input_ids"], f["token_type_ids"], f["lengths"]
  except (OSError, ValueError, KeyError) as e:
    _log.warning("Ignoring unreadable tokenization cache %s: %s", path, e)
    return None
  if len(lengths) != num_examples or int(lengths.sum()) != len(ids) or len(types) != len(ids):
    _log.warning("Ignoring inconsistent tokenization cache %s", path)
    return None
  return ids, types, lengths


def _write_cache(path: pathlib.Path, **arrays) -> None:
  # Write-then-rename: several processes (hosts sharing a filesystem) may fill the same entry,
  # and a reader must never see a half-written file.
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
  except OSError as e:
    _log.warning("Could not write tokenization cache %s: %s", path, e)


def load_encoded(task: str | TaskSpec, split: str, tokenizer, *, max_length: int,
                 glue_dir: str | os.PathLike | None = None,
                 cache_dir: str | os.PathLike | bool | None = None) -> Encoded:
  """load_split followed by encode."""
  examples = load_split(task, split, glue_dir=glue_dir)
  return encode(examples, tokenizer, max_length=max_length, cache_dir=cache_dir)


def bucket_boundaries(max_length: int, buckets: Sequence[int] | None = ()) -> tuple[int, ...]:
  """Sorted distinct bucket lengths clipped to max_length, always ending at max_length."""
  if max_length < 1:
    raise ValueError(f"max_length must be positive, got {max_length}")
  buckets = tuple(buckets or ())
  if any(b < 1 for b in buckets):
    raise ValueError(f"bucket lengths must be positive, got {buckets}")
  return tuple(sorted({min(int(b), max_length) for b in buckets} | {int(max_length)}))


def _bucket_ids(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
  bounds = np.asarray(boundaries)
  if len(bounds) == 0 or np.any(np.diff(bounds) <= 0):
    raise ValueError(f"boundaries must be non-empty and increasing, got {tuple(boundaries)}")
  if len(lengths) and lengths.max() > bounds[-1]:
    raise ValueError(f"an example has {lengths.max()} tokens but the largest bucket is "
                     f"{bounds[-1]}; encode with max_length <= the last boundary")
  return np.searchsorted(bounds, lengths, side="left")


def _chunks(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
  """Cuts indices into batch_size rows, the last one padded with -1 (a masked row)."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  num = -(-len(indices) // batch_size)
  padded = np.full(num * batch_size, -1, np.int64)
  padded[:len(indices)] = indices
  return list(padded.reshape(num, batch_size))


def _train_plan(encoded: Encoded, batch_size: int, boundaries: Sequence[int], seed: int,
                epoch: int) -> list[tuple[int, np.ndarray]]:
  """(bucket length, example indices) per batch, in this epoch's order. Cheap: no tokens."""
  bucket = _bucket_ids(encoded.lengths, boundaries)
  rng = np.random.default_rng([seed, epoch])
  order = rng.permutation(len(encoded))
  plan = []
  for b, length in enumerate(boundaries):
    plan.extend((int(length), chunk) for chunk in _chunks(order[bucket[order] == b], batch_size))
  return [plan[i] for i in rng.permutation(len(plan))]


def num_train_batches(encoded: Encoded, *, batch_size: int, boundaries: Sequence[int]) -> int:
  """Batches per epoch of train_batches; the same for every epoch and seed."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  counts = np.bincount(_bucket_ids(encoded.lengths, boundaries), minlength=len(boundaries))
  return int(sum(-(-int(c) // batch_size) for c in counts))


def train_batches(encoded: Encoded, *, batch_size: int, boundaries: Sequence[int], seed: int,
                  epoch: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """One epoch of shuffled fixed-shape batches, starting at batch `start` (for resuming).

  The order depends only on (seed, epoch). Each bucket's last partial batch is padded with
  masked rows, so every example is seen exactly once per epoch and shapes stay fixed.
  """
  if encoded.labels is None:
    raise ValueError("cannot train on a split without labels")
  if start < 0:
    raise ValueError(f"start must be >= 0, got {start}")
  for length, indices in _train_plan(encoded, batch_size, boundaries, seed, epoch)[start:]:
    yield make_batch(encoded, indices, length)


def eval_batches(encoded: Encoded, *, batch_size: int, boundaries: Sequence[int]
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Deterministic batches grouped by bucket; every example appears exactly once (mask=1)."""
  bucket = _bucket_ids(encoded.lengths, boundaries)
  for b, length in enumerate(boundaries):
    for indices in _chunks(np.flatnonzero(bucket == b), batch_size):
      yield make_batch(encoded, indices, int(length))


def make_batch(encoded: Encoded, indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
  """The padded batch of the given example indices (-1 = padding row) at sequence length.

  Keys: input_ids, token_type_ids, attention_mask (int32 [B, T]), labels ([B]; absent for
  unlabeled splits), mask (float32 [B], 1 = real example), index (int32 [B], -1 = padding).
  """
  indices = np.asarray(indices)
  real = indices >= 0
  safe = np.where(real, indices, 0)
  lengths = np.where(real, encoded.lengths[safe], 0)
  if np.any(lengths > length):
    raise ValueError(f"an example has {lengths.max()} tokens, more than the length {length}")
  positions = np.arange(length)
  tokens = positions[None, :] < lengths[:, None]
  gather = np.where(tokens, encoded.offsets[safe][:, None] + positions[None, :], 0)
  input_ids = np.where(tokens, encoded.input_ids[gather], encoded.pad_id).astype(np.int32)
  token_type_ids = np.where(tokens, encoded.token_type_ids[gather], 0).astype(np.int32)
  batch = {
      "input_ids": input_ids,
      "token_type_ids": token_type_ids,
      "attention_mask": tokens.astype(np.int32),
      "mask": real.astype(np.float32),
      "index": np.where(real, indices, -1).astype(np.int32),
  }
  if encoded.labels is not None:
    batch["labels"] = np.where(real, encoded.labels[safe], 0).astype(encoded.labels.dtype)
  return batch

