"""GLUE loading on the real offline TSVs, tokenization and its cache, fixed-shape batches."""

import collections
import pathlib
import time

import numpy as np
import pytest

from acl_jax import data

# Rows and label counts (by label id, i.e. hub ClassLabel order) from shared/data/glue/SOURCES.md.
EXPECTED = {
    ("rte", "train"): (2490, {0: 1249, 1: 1241}),
    ("rte", "validation"): (277, {0: 146, 1: 131}),
    ("mrpc", "train"): (3668, {1: 2474, 0: 1194}),
    ("mrpc", "validation"): (408, {1: 279, 0: 129}),
    ("cola", "train"): (8551, {1: 6023, 0: 2528}),
    ("cola", "validation"): (1043, {1: 721, 0: 322}),
    ("sst2", "train"): (67349, {1: 37569, 0: 29780}),
    ("sst2", "validation"): (872, {1: 444, 0: 428}),
    ("stsb", "train"): (5749, None),
    ("stsb", "validation"): (1500, None),
    ("wnli", "train"): (635, {1: 312, 0: 323}),
    ("wnli", "validation"): (71, {1: 31, 0: 40}),
    ("qnli", "validation"): (5463, {0: 2702, 1: 2761}),
}
TEST_ROWS = {"cola": 1063, "mrpc": 1725, "qnli": 5463, "rte": 3000, "sst2": 1821, "stsb": 1379,
             "wnli": 146}


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  import transformers
  return transformers.AutoTokenizer.from_pretrained(str(minilm_dir))


@pytest.fixture(scope="module")
def rte_dev(glue_dir):
  return data.load_split("rte", "validation", glue_dir=glue_dir)


@pytest.fixture(scope="module")
def rte_dev_encoded(rte_dev, tokenizer):
  return data.encode(rte_dev, tokenizer, max_length=128, cache_dir=False)


def _write(root: pathlib.Path, task_dir: str, stem: str, text: str) -> pathlib.Path:
  path = root / task_dir / f"{stem}.tsv"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text, encoding="utf-8")
  return path


# --- registry ---------------------------------------------------------------------------------

def test_registry_names_and_aliases():
  assert set(data.TASKS) == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"}
  assert data.get_task("SST-2") is data.TASKS["sst2"]
  assert data.get_task("sts-b") is data.TASKS["stsb"]
  assert data.get_task("CoLA") is data.TASKS["cola"]
  assert data.get_task(data.TASKS["rte"]) is data.TASKS["rte"]
  with pytest.raises(ValueError, match="cola, sst2, mrpc"):
    data.get_task("squad")


def test_task_properties():
  stsb, mnli, rte, cola = (data.get_task(n) for n in ("stsb", "mnli", "rte", "cola"))
  assert stsb.is_regression and stsb.num_labels == 1 and stsb.main_metric == "pearson"
  assert not rte.is_regression and rte.num_labels == 2 and rte.labels == ("entailment",
                                                                          "not_entailment")
  # The hub's ClassLabel order, so ids agree between the TSV and hub sources.
  assert mnli.labels == ("entailment", "neutral", "contradiction")
  assert mnli.eval_splits == {"validation_matched": "dev_matched",
                              "validation_mismatched": "dev_mismatched"}
  assert cola.metrics == ("mcc",)
  assert data.get_task("mrpc").metrics == ("f1", "accuracy")
  assert cola.tsv_column_names == ("source", "label", "label_notes", "sentence")
  hash(rte)  # usable as a static argument / dict key


def test_resolve_glue_dir(monkeypatch, tmp_path):
  monkeypatch.delenv("GLUE_DIR", raising=False)
  assert data.resolve_glue_dir(None) is None
  monkeypatch.setenv("GLUE_DIR", str(tmp_path))
  assert data.resolve_glue_dir(None) == tmp_path
  assert data.resolve_glue_dir(str(tmp_path / "x")) == tmp_path / "x"


# --- loading the real files -------------------------------------------------------------------

@pytest.mark.parametrize("task,split", sorted(EXPECTED))
def test_real_row_counts_and_label_distributions(glue_dir, task, split):
  examples = data.load_split(task, split, glue_dir=glue_dir)
  rows, counts = EXPECTED[task, split]
  assert len(examples) == rows == len(examples.line_numbers) == len(examples.labels)
  assert (examples.text_b is None) == (task in ("cola", "sst2"))
  if counts is None:
    assert examples.labels.dtype == np.float32
    assert examples.labels.min() == 0.0 and examples.labels.max() == 5.0
  else:
    assert examples.labels.dtype == np.int32
    assert dict(collections.Counter(examples.labels.tolist())) == counts


@pytest.mark.parametrize("task", sorted(TEST_ROWS))
def test_test_splits_have_no_labels(glue_dir, task):
  examples = data.load_split(task, "test", glue_dir=glue_dir)
  assert len(examples) == TEST_ROWS[task] and examples.labels is None


def test_text_and_line_numbers_equal_a_plain_tab_split(glue_dir):
  # MRPC has the BOM header and many fields that begin with a quote.
  examples = data.load_split("mrpc", "train", glue_dir=glue_dir)
  lines = (glue_dir / "MRPC" / "train.tsv").read_text(encoding="utf-8-sig").split("\n")
  rows = [line.split("\t") for line in lines[1:] if line]
  assert examples.text_a == [r[3] for r in rows]
  assert examples.text_b == [r[4] for r in rows]
  assert sum(t.startswith('"') for t in examples.text_b) > 10
  assert examples.line_numbers.tolist() == list(range(2, len(rows) + 2))
  # CoLA train has no header: its first row is line 1.
  cola = data.load_split("cola", "train", glue_dir=glue_dir)
  assert cola.line_numbers[0] == 1 and cola.text_a[0].startswith("Our friends won't")


def test_quotes_at_line_and_field_starts_do_not_merge_rows(tmp_path):
  _write(tmp_path, "CoLA", "train",
         '"gj04\t1\t\t"An unclosed quote opens this sentence.\n'
         'gj04\t0\t*\tnull\n'
         '"x"\t1\t\t"quoted" and NA\n'
         'gj04\t1\t\tThe last one.\n')
  examples = data.load_split("cola", "train", glue_dir=tmp_path)
  assert examples.text_a == ['"An unclosed quote opens this sentence.', "null",
                             '"quoted" and NA', "The last one."]
  assert examples.labels.tolist() == [1, 0, 1, 1]
  assert examples.line_numbers.tolist() == [1, 2, 3, 4]


def test_crlf_line_endings(tmp_path):
  _write(tmp_path, "RTE", "dev",
         "index\tsentence1\tsentence2\tlabel\r\n0\ta\tb\tentailment\r\n1\tc\td\tnot_entailment\r\n")
  examples = data.load_split("rte", "validation", glue_dir=tmp_path)
  assert examples.text_b == ["b", "d"] and examples.labels.tolist() == [0, 1]


@pytest.mark.parametrize("task, text, header", [
    ("RTE", "index\tsentence1\tsentence2\tlabel\n", True),  # a header and nothing else
    ("CoLA", "", False)])  # CoLA's train.tsv has no header: an empty file
def test_a_split_without_examples_names_the_file(tmp_path, task, text, header):
  path = _write(tmp_path, task, "train", text)
  with pytest.raises(ValueError) as e:
    data.load_split(task, "train", glue_dir=tmp_path)
  assert str(path) in str(e.value) and "no examples" in str(e.value)
  assert ("below its header" in str(e.value)) == header


@pytest.mark.parametrize("bad_row,found", [("2\tc\td\tentailment\textra", 5), ("2\tc\td", 3)])
def test_wrong_field_count_names_file_and_line(tmp_path, bad_row, found):
  path = _write(tmp_path, "RTE", "train",
                "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
                "1\ta\tb\tnot_entailment\n" + bad_row + "\n3\te\tf\tentailment\n")
  with pytest.raises(ValueError) as e:
    data.load_split("rte", "train", glue_dir=tmp_path)
  assert f"{path}:4" in str(e.value) and f"found {found}" in str(e.value)


def test_unknown_label_names_value_line_and_valid_labels(tmp_path):
  path = _write(tmp_path, "RTE", "train",
                "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tneutral\n")
  with pytest.raises(ValueError) as e:
    data.load_split("rte", "train", glue_dir=tmp_path)
  message = str(e.value)
  assert f"{path}:3" in message and "'neutral'" in message
  assert "'entailment'" in message and "'not_entailment'" in message


def test_non_numeric_stsb_score(tmp_path):
  header = ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
            "\tscore\n")
  row = "0\tg\tf\t2012\t0001\tnone\tnone\tA plane.\tA jet.\t{}\n"
  path = _write(tmp_path, "STS-B", "dev", header + row.format("4.2") + row.format("n/a"))
  with pytest.raises(ValueError) as e:
    data.load_split("stsb", "validation", glue_dir=tmp_path)
  assert f"{path}:3" in str(e.value) and "'n/a'" in str(e.value)


def test_missing_file_explains_layout(tmp_path, glue_dir):
  with pytest.raises(FileNotFoundError) as e:
    data.load_split("rte", "train", glue_dir=tmp_path)
  message = str(e.value)
  assert str(tmp_path / "RTE" / "train.tsv") in message
  assert "<GLUE_DIR>/RTE/train.tsv" in message and "GLUE_DIR" in message
  with pytest.raises(FileNotFoundError, match="QNLI"):
    data.load_split("qnli", "train", glue_dir=glue_dir)  # QNLI train is not in the offline copy


def test_unknown_split(glue_dir):
  with pytest.raises(ValueError, match="validation_matched"):
    data.load_split("mnli", "validation", glue_dir=glue_dir)
  with pytest.raises(ValueError, match="train, validation, test"):
    data.load_split("rte", "dev", glue_dir=glue_dir)


def test_glue_dir_env_is_used(monkeypatch, glue_dir):
  monkeypatch.setenv("GLUE_DIR", str(glue_dir))
  assert len(data.load_split("wnli", "validation")) == 71


# --- tokenization -----------------------------------------------------------------------------

@pytest.mark.parametrize("task,max_length", [("rte", 64), ("cola", 16)])
def test_encode_equals_per_example_tokenizer(glue_dir, tokenizer, task, max_length):
  examples = data.load_split(task, "validation", glue_dir=glue_dir)
  encoded = data.encode(examples, tokenizer, max_length=max_length, cache_dir=False)
  assert len(encoded) == len(examples)
  assert encoded.input_ids.dtype == encoded.token_type_ids.dtype == np.int32
  assert encoded.offsets[-1] == len(encoded.input_ids) and encoded.lengths.max() <= max_length
  assert encoded.pad_id == tokenizer.pad_token_id == 0
  np.testing.assert_array_equal(encoded.labels, examples.labels)
  truncated = 0
  for i in range(len(examples)):
    b = examples.text_b[i] if examples.text_b is not None else None
    ref = tokenizer(examples.text_a[i], b, truncation="longest_first", max_length=max_length)
    ids, types = encoded.example(i)
    assert ids.tolist() == ref["input_ids"], i
    assert types.tolist() == ref["token_type_ids"], i
    truncated += len(ids) == max_length
  assert truncated > 0  # the truncation path was exercised


def test_cache_hit_skips_the_tokenizer(rte_dev, tokenizer, tmp_path, monkeypatch):
  first = data.encode(rte_dev, tokenizer, max_length=128, cache_dir=tmp_path)
  files = list(tmp_path.glob("*.npz"))
  assert len(files) == 1

  def refuse(*args, **kwargs):
    raise AssertionError("tokenizer called on a cache hit")

  monkeypatch.setattr(type(tokenizer), "__call__", refuse)
  again = data.encode(rte_dev, tokenizer, max_length=128, cache_dir=tmp_path)
  for name in ("input_ids", "token_type_ids", "offsets", "lengths", "labels"):
    np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
  # Another max_length is another key: it must tokenize (and here, hit the refusal).
  with pytest.raises(AssertionError, match="cache hit"):
    data.encode(rte_dev, tokenizer, max_length=64, cache_dir=tmp_path)


def test_cache_respects_env_and_can_be_disabled(rte_dev, tokenizer, tmp_path, monkeypatch):
  monkeypatch.setenv("ACL_JAX_CACHE", str(tmp_path / "env"))
  data.encode(rte_dev, tokenizer, max_length=32)
  assert len(list((tmp_path / "env").glob("*.npz"))) == 1
  monkeypatch.setenv("ACL_JAX_CACHE", str(tmp_path / "off"))
  data.encode(rte_dev, tokenizer, max_length=32, cache_dir=False)
  assert not (tmp_path / "off").exists()


def test_cache_key_follows_the_text(rte_dev, tokenizer, tmp_path):
  data.encode(rte_dev, tokenizer, max_length=32, cache_dir=tmp_path)
  edited = data.Examples(text_a=["changed"] + rte_dev.text_a[1:], text_b=rte_dev.text_b,
                         labels=rte_dev.labels, source=rte_dev.source,
                         line_numbers=rte_dev.line_numbers, task="rte", split="validation")
  encoded = data.encode(edited, tokenizer, max_length=32, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("*.npz"))) == 2
  assert encoded.example(0)[0].tolist() == tokenizer("changed", rte_dev.text_b[0],
                                                     truncation="longest_first",
                                                     max_length=32)["input_ids"]


def test_sst2_train_tokenizes_in_seconds(glue_dir, tokenizer):
  examples = data.load_split("sst2", "train", glue_dir=glue_dir)
  start = time.perf_counter()
  encoded = data.encode(examples, tokenizer, max_length=64, cache_dir=False)
  elapsed = time.perf_counter() - start
  assert len(encoded) == 67349 and elapsed < 30, elapsed
  i = 12345
  ref = tokenizer(examples.text_a[i], truncation=True, max_length=64)["input_ids"]
  assert encoded.example(i)[0].tolist() == ref


# --- batches ----------------------------------------------------------------------------------

def test_bucket_boundaries():
  assert data.bucket_boundaries(128, (32, 64)) == (32, 64, 128)
  assert data.bucket_boundaries(128, (64, 32, 64)) == (32, 64, 128)
  assert data.bucket_boundaries(128, (32, 256)) == (32, 128)
  assert data.bucket_boundaries(128, (128,)) == (128,)
  assert data.bucket_boundaries(128, ()) == (128,)
  assert data.bucket_boundaries(128, None) == (128,)
  with pytest.raises(ValueError):
    data.bucket_boundaries(128, (0, 64))


def _check_batch(batch, encoded, boundaries, batch_size):
  b, t = batch["input_ids"].shape
  assert b == batch_size and t in boundaries
  for key in ("input_ids", "token_type_ids", "attention_mask"):
    assert batch[key].shape == (b, t) and batch[key].dtype == np.int32
  assert batch["mask"].dtype == np.float32 and batch["index"].dtype == np.int32
  assert batch["labels"].shape == (b,) and batch["labels"].dtype == encoded.labels.dtype
  smaller = [x for x in boundaries if x < t]
  for row, i in enumerate(batch["index"]):
    if i < 0:
      assert batch["mask"][row] == 0 and not batch["attention_mask"][row].any()
      assert not batch["input_ids"][row].any()
      continue
    assert batch["mask"][row] == 1
    ids, types = encoded.example(i)
    n = len(ids)
    assert n <= t and (not smaller or n > smaller[-1])  # the smallest bucket that holds it
    assert batch["input_ids"][row, :n].tolist() == ids.tolist()
    assert batch["token_type_ids"][row, :n].tolist() == types.tolist()
    assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (t - n)
    assert not batch["input_ids"][row, n:].any()  # pad id 0
    assert batch["labels"][row] == encoded.labels[i]


def test_train_batches_fixed_shapes_each_example_once(rte_dev_encoded):
  encoded, boundaries = rte_dev_encoded, data.bucket_boundaries(128, (32, 64))
  batches = list(data.train_batches(encoded, batch_size=16, boundaries=boundaries, seed=0,
                                    epoch=0))
  assert len(batches) == data.num_train_batches(encoded, batch_size=16, boundaries=boundaries)
  assert len({b["input_ids"].shape for b in batches}) <= len(boundaries)
  for batch in batches:
    _check_batch(batch, encoded, boundaries, 16)
  seen = np.concatenate([b["index"][b["index"] >= 0] for b in batches])
  assert sorted(seen.tolist()) == list(range(len(encoded)))
  assert sum(b["mask"].sum() for b in batches) == len(encoded)


def test_train_order_depends_only_on_seed_and_epoch(rte_dev_encoded):
  kwargs = dict(batch_size=8, boundaries=data.bucket_boundaries(128, (48, 80)))

  def order(seed, epoch, start=0):
    return [b["index"].tolist() for b in data.train_batches(rte_dev_encoded, seed=seed,
                                                            epoch=epoch, start=start, **kwargs)]

  first = order(0, 0)
  assert order(0, 0) == first
  assert order(0, 1) != first and order(1, 0) != first
  for start in (0, 1, 7, len(first) - 1, len(first)):
    assert order(0, 0, start) == first[start:]
  assert data.num_train_batches(rte_dev_encoded, **kwargs) == len(order(3, 5))


def test_train_resume_skips_without_building_batches(rte_dev_encoded, monkeypatch):
  built = []
  real = data.make_batch
  monkeypatch.setattr(data, "make_batch", lambda *a, **k: built.append(1) or real(*a, **k))
  batches = data.train_batches(rte_dev_encoded, batch_size=8, boundaries=(128,), seed=0,
                               epoch=2, start=30)
  next(batches)
  assert len(built) == 1


def test_train_batches_need_labels(glue_dir, tokenizer):
  test = data.encode(data.load_split("wnli", "test", glue_dir=glue_dir), tokenizer,
                     max_length=128, cache_dir=False)
  with pytest.raises(ValueError, match="labels"):
    next(data.train_batches(test, batch_size=8, boundaries=(128,), seed=0, epoch=0))
  batch = next(data.eval_batches(test, batch_size=8, boundaries=(128,)))
  assert "labels" not in batch and batch["mask"].sum() == 8


def test_eval_batches_cover_rte_dev_exactly_once(rte_dev_encoded):
  encoded = rte_dev_encoded
  assert len(encoded) == 277
  for boundaries in [(128,), data.bucket_boundaries(128, (32, 64))]:
    batches = list(data.eval_batches(encoded, batch_size=32, boundaries=boundaries))
    for batch in batches:
      _check_batch(batch, encoded, boundaries, 32)
    index = np.concatenate([b["index"] for b in batches])
    mask = np.concatenate([b["mask"] for b in batches])
    real = index[index >= 0]
    assert sorted(real.tolist()) == list(range(277))
    assert mask.sum() == 277 and (mask == (index >= 0)).all()
    # Deterministic, and padding rows only at the end of each bucket.
    again = list(data.eval_batches(encoded, batch_size=32, boundaries=boundaries))
    assert all((a["index"] == b["index"]).all() for a, b in zip(batches, again))
  assert len(list(data.eval_batches(encoded, batch_size=32, boundaries=(128,)))) == 9


def test_regression_batches_carry_float_labels(glue_dir, tokenizer):
  encoded = data.load_encoded("stsb", "validation", tokenizer, max_length=64, glue_dir=glue_dir,
                              cache_dir=False)
  assert encoded.labels.dtype == np.float32 and len(encoded) == 1500
  batch = next(data.train_batches(encoded, batch_size=8, boundaries=(64,), seed=0, epoch=0))
  assert batch["labels"].dtype == np.float32


def test_hub_path_maps_columns_and_hides_test_labels(monkeypatch):
  """No network here: a stand-in for datasets.load_dataset checks what the hub path asks for."""
  import datasets

  calls = []

  def fake_load_dataset(path, name, *, split):
    calls.append((path, name, split))
    labels = [-1, -1] if split.startswith("test") else [2, 0]
    return datasets.Dataset.from_dict({"premise": ["p0", "p1"], "hypothesis": ["h0", "h1"],
                                       "label": labels, "idx": [0, 1]})

  monkeypatch.delenv("GLUE_DIR", raising=False)
  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  dev = data.load_split("mnli", "validation_mismatched")
  assert calls[-1] == ("nyu-mll/glue", "mnli", "validation_mismatched")
  assert dev.text_a == ["p0", "p1"] and dev.text_b == ["h0", "h1"]
  assert dev.labels.tolist() == [2, 0] and dev.labels.dtype == np.int32
  assert dev.line_numbers.tolist() == [1, 2] and "nyu-mll/glue" in dev.source
  test = data.load_split("mnli", "test_matched")
  assert calls[-1] == ("nyu-mll/glue", "mnli", "test_matched") and test.labels is None
