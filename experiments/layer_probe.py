"""How well each layer of a pretrained BERT predicts a GLUE label, pooled by [CLS] or by the mean.

    python experiments/layer_probe.py --model minilm --task mrpc

A frozen-feature linear probe (HF PyTorch, so independent of our Linen model): for every layer
(0 = the embeddings) and for two poolings, [CLS] (what a multi-exit BERT's exits read) and the
masked mean over tokens (what sentence encoders such as all-MiniLM-L6-v2 were trained for), it
fits a ridge classifier on the train split and scores the dev split with the task's metric. The
ridge strength is chosen per layer and pooling on a held-out fifth of train, then refit on all of
it. The majority class is printed first for scale. One JSON line per (layer, pooling).

It asks what fine-tuning starts from: if a layer's [CLS] state scores like the majority class
while its mean scores well above, a [CLS] exit at that layer has little to work with.
"""

import argparse
import dataclasses
import json

import numpy as np
import torch
import transformers

from acl_jax import data
from acl_jax import hf_weights
from acl_jax import metrics

POOLINGS = ("cls", "mean")
RIDGES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


def pooled_layers(model, tokenizer, examples, *, max_length: int, batch_size: int
                  ) -> dict[str, np.ndarray]:
  """{pooling: [L+1, N, H]} for every layer's output, examples in their given order."""
  n = len(examples.labels)
  text_b = examples.text_b
  order = np.argsort([len(a) + (len(text_b[i]) if text_b else 0)
                      for i, a in enumerate(examples.text_a)])  # similar lengths pad less
  out = {pooling: [None] * n for pooling in POOLINGS}
  for start in range(0, n, batch_size):
    idx = order[start:start + batch_size]
    batch = tokenizer([examples.text_a[i] for i in idx],
                      [text_b[i] for i in idx] if text_b else None,
                      padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
    with torch.no_grad():
      hidden = torch.stack(model(**batch, output_hidden_states=True).hidden_states)
    mask = batch["attention_mask"][None, :, :, None].to(hidden.dtype)  # [1, B, T, 1]
    cls = hidden[:, :, 0].numpy()
    mean = ((hidden * mask).sum(2) / mask.sum(2)).numpy()
    for j, i in enumerate(idx):
      out["cls"][i], out["mean"][i] = cls[:, j], mean[:, j]
  return {pooling: np.stack(vectors, 1) for pooling, vectors in out.items()}


def fit_ridge(features: np.ndarray, labels: np.ndarray, num_labels: int, ridge: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(mean, scale, weights [H+1, K]): a one-vs-rest ridge classifier on standardized features.

  `ridge` is relative to the number of examples, so one grid serves every split size.
  """
  mean, scale = features.mean(0), features.std(0) + 1e-6
  x = np.concatenate([(features - mean) / scale, np.ones((len(features), 1))], axis=1)
  targets = 2.0 * np.eye(num_labels)[labels] - 1.0
  penalty = ridge * len(features) * np.eye(x.shape[1])
  penalty[-1, -1] = 0.0  # the bias is not shrunk
  weights = np.linalg.solve(x.T @ x + penalty, x.T @ targets)
  return mean, scale, weights


def predict_ridge(fit, features: np.ndarray) -> np.ndarray:
  mean, scale, weights = fit
  x = np.concatenate([(features - mean) / scale, np.ones((len(features), 1))], axis=1)
  return (x @ weights).argmax(-1)


def probe(train_x, train_y, dev_x, dev_y, num_labels: int, score, *, seed: int = 0
          ) -> dict[str, float]:
  """Pick the ridge on a held-out fifth of train, refit on all of train, score dev."""
  held = np.random.default_rng(seed).permutation(len(train_y))
  cut = len(held) // 5
  val, fit_part = held[:cut], held[cut:]
  chosen = max(RIDGES, key=lambda r: score(predict_ridge(
      fit_ridge(train_x[fit_part], train_y[fit_part], num_labels, r), train_x[val]),
      train_y[val]))
  fit = fit_ridge(train_x, train_y, num_labels, chosen)
  return {"ridge": chosen, "train": score(predict_ridge(fit, train_x), train_y),
          "dev": score(predict_ridge(fit, dev_x), dev_y)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="minilm", help="a preset, local directory or hub id")
  parser.add_argument("--task", default="mrpc")
  parser.add_argument("--train_examples", type=int, default=None,
                      help="the first N train examples (default: all)")
  parser.add_argument("--max_length", type=int, default=128)
  parser.add_argument("--batch_size", type=int, default=64)
  args = parser.parse_args()
  task = data.get_task(args.task)
  if task.num_labels == 1:
    raise SystemExit(f"--task {args.task}: a regression task; the probe classifies")
  ckpt_dir = hf_weights.resolve(args.model)
  tokenizer = hf_weights.load_tokenizer(ckpt_dir)
  model = transformers.BertModel.from_pretrained(str(ckpt_dir)).eval()
  train = data.load_split(task, "train")
  if args.train_examples is not None:
    n = args.train_examples
    train = dataclasses.replace(train, text_a=train.text_a[:n],
                                text_b=train.text_b[:n] if train.text_b else None,
                                labels=train.labels[:n], line_numbers=train.line_numbers[:n])
  dev = data.load_split(task, "validation")

  def score(preds, labels) -> float:
    return metrics.main_score(task, metrics.compute(task, preds, labels))

  metric = task.main_metric
  majority = np.bincount(train.labels, minlength=task.num_labels).argmax()
  print(json.dumps({"model": args.model, "task": task.name, "pooling": "majority class",
                    "metric": metric, "dev": round(score(np.full_like(dev.labels, majority),
                                                         dev.labels), 4)}), flush=True)
  encode = dict(max_length=args.max_length, batch_size=args.batch_size)
  train_feats = pooled_layers(model, tokenizer, train, **encode)
  dev_feats = pooled_layers(model, tokenizer, dev, **encode)
  for layer in range(train_feats["cls"].shape[0]):
    for pooling in POOLINGS:
      result = probe(train_feats[pooling][layer], train.labels, dev_feats[pooling][layer],
                     dev.labels, task.num_labels, score)
      print(json.dumps({"model": args.model, "task": task.name, "layer": layer,
                        "pooling": pooling, "metric": metric, "train_examples": len(train.labels),
                        "dev_examples": len(dev.labels), "ridge": result["ridge"],
                        "train": round(result["train"], 4), "dev": round(result["dev"], 4)}),
            flush=True)


if __name__ == "__main__":
  main()
