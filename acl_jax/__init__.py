"""Aligned Contrastive Learning (ACL) for BERT and multi-exit BERT fine-tuning, in JAX/Flax."""

__version__ = "0.1.0"
