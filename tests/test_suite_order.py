"""The suite hands xdist's workers its longest modules first, in the order the seconds a run
recorded give (tests/conftest.py), and `--record-module-seconds` records a run's own."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO_ROOT

MODULES = ("tests/test_metrics.py", "tests/test_config.py", "tests/test_install.py")


def _pytest(seconds_file, *args) -> subprocess.CompletedProcess:
  env = dict(os.environ, ACL_JAX_TEST_MODULE_SECONDS=str(seconds_file))
  env.pop("PYTEST_ADDOPTS", None)  # this run's options (-v, say) would change the output read here
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                         *MODULES], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def test_modules_run_longest_first_and_a_run_records_the_seconds_of_the_modules_it_ran(tmp_path):
  seconds_file = tmp_path / "module_seconds.json"
  seconds_file.write_text(json.dumps({"seconds": {
      "test_metrics.py": 1.0, "test_config.py": 50.0, "test_removed.py": 7.0}}))

  collected = _pytest(seconds_file, "-n", "0", "--collect-only")
  assert collected.returncode == 0, collected.stdout[-3000:]
  order = list(dict.fromkeys(re.findall(r"^(tests/test_\w+\.py)::", collected.stdout, re.M)))
  # test_install.py has no seconds yet: its cost is unknown, so it goes first.
  assert order == ["tests/test_install.py", "tests/test_config.py", "tests/test_metrics.py"]

  # Two workers: the controlling process sums their reports and writes the file once.
  recorded = _pytest(seconds_file, "-n", "2", "--record-module-seconds")
  assert recorded.returncode == 0, recorded.stdout[-3000:]
  seconds = json.loads(seconds_file.read_text())["seconds"]
  assert set(seconds) == {"test_metrics.py", "test_config.py", "test_install.py",
                          "test_removed.py"}
  assert seconds["test_removed.py"] == 7.0  # not run: kept
  assert seconds["test_config.py"] < 50.0  # run: this run's seconds replace the old
  assert list(seconds.values()) == sorted(seconds.values(), reverse=True)
