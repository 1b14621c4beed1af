"""The README's install (`pip install -e .`, no extras) provides every module the package
imports, at module level or inside a function, except the optional ones named here."""

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "acl_jax"
# Imported only on paths that say which extra they need: torch reads pickled `.bin`
# checkpoints (allow_pickle), and the tests' reference; tensorboard and wandb are the trackers
# (acl_jax.tracking: tensorboard is skipped with a warning when missing, wandb only on request).
OPTIONAL = {"torch", "tensorboard", "wandb"}


def imported_top_level_names() -> dict[str, str]:
  """{top-level module: first file:line importing it} over every acl_jax source file."""
  names = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        modules = [node.module]
      else:
        continue
      for module in modules:
        names.setdefault(module.split(".")[0], f"{path.name}:{node.lineno}")
  return names


def base_requirements(distribution: str) -> set[str]:
  """The distributions `distribution` requires without extras, normalized."""
  out = set()
  for requirement in importlib.metadata.requires(distribution) or ():
    if "extra ==" in requirement.replace('"', "").replace("'", ""):
      continue
    out.add(_normalize(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]))
  return out


def _normalize(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def test_the_default_install_provides_every_import():
  closure, todo = set(), [_normalize("acl_jax")]
  while todo:  # the default install: acl_jax's base requirements and theirs, transitively
    name = todo.pop()
    if name in closure:
      continue
    closure.add(name)
    try:
      todo.extend(base_requirements(name))
    except importlib.metadata.PackageNotFoundError:
      pass  # a marker-excluded requirement (another platform or Python)
  assert "matplotlib" in closure  # early_exit.png (it once needed the plots extra)
  providers = importlib.metadata.packages_distributions()
  missing = []
  for module, where in imported_top_level_names().items():
    if module in sys.stdlib_module_names or module == "acl_jax" or module in OPTIONAL:
      continue
    dists = {_normalize(d) for d in providers.get(module, ())}
    if not dists & closure:
      missing.append(f"{module} ({where}; provided by {sorted(dists) or 'nothing installed'})")
  assert not missing, f"imported but not in the default install: {missing}"


def test_the_suites_caches_leave_with_their_process():
  """conftest's token and compilation caches (and those of the child processes that import it)
  are deleted when the process exits."""
  root = PACKAGE.parent
  out = subprocess.run([sys.executable, "-c", "from tests import conftest as c; "
                        "print(c.TOKEN_CACHE, c.XLA_CACHE, c.TOKEN_CACHE.is_dir())"],
                       cwd=root, capture_output=True, text=True, check=True).stdout.split()
  tokens, xla, existed = out
  assert existed == "True"
  assert not pathlib.Path(tokens).exists() and not pathlib.Path(xla).exists()
