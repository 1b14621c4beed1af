"""GLUE fine-tuning configs, for `--config=configs/glue.py:<preset string>`.

    python -m acl_jax.main --config=configs/glue.py:rte --workdir=runs/rte
    python -m acl_jax.main --config=configs/glue.py:rte,model=minilm,objective=ce,seed=1 ...

The argument after the colon is the task name and `field=value` presets (big_vision style);
`--config.<field>=value` overrides any field afterwards. The fields, their defaults and the
preset rules live in acl_jax/config.py (import acl_jax.config in Python code).
"""

from acl_jax.config import get_config  # noqa: F401  (config_flags calls configs/glue.py's)
