"""How much each layer's [CLS] hidden state varies across dev examples (HF PyTorch, pretrained).

    python experiments/cls_spread.py --model minilm --task mrpc --examples 64

A [CLS]-pooled exit can only classify if the [CLS] state after its layer depends on the input.
Spread = the mean distance of the examples' [CLS] vectors from their mean, relative to the
mean's norm; the second token's spread is printed beside it for scale. One JSON line per layer.
"""

import argparse
import json

import numpy as np
import torch
import transformers

from acl_jax import data
from acl_jax import hf_weights


def spread(vectors: np.ndarray) -> float:
  center = vectors.mean(0)
  return float(np.linalg.norm(vectors - center, axis=-1).mean() / np.linalg.norm(center))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="minilm", help="a preset, local directory or hub id")
  parser.add_argument("--task", default="mrpc")
  parser.add_argument("--examples", type=int, default=64)
  args = parser.parse_args()
  ckpt_dir = hf_weights.resolve(args.model)
  tokenizer = hf_weights.load_tokenizer(ckpt_dir)
  model = transformers.BertModel.from_pretrained(str(ckpt_dir)).eval()
  examples = data.load_split(args.task, "validation")
  n = args.examples
  batch = tokenizer(examples.text_a[:n], examples.text_b[:n] if examples.text_b else None,
                    padding=True, truncation=True, max_length=128, return_tensors="pt")
  with torch.no_grad():
    hidden_states = model(**batch, output_hidden_states=True).hidden_states
  for layer, hidden in enumerate(hidden_states):  # layer 0: the embeddings
    hidden = hidden.numpy()
    print(json.dumps({"model": args.model, "task": args.task, "examples": n, "layer": layer,
                      "cls_spread": round(spread(hidden[:, 0]), 4),
                      "token1_spread": round(spread(hidden[:, 1]), 4)}))


if __name__ == "__main__":
  main()
