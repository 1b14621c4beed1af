"""Data parallelism: 8 simulated CPU devices train exactly like one device."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from acl_jax import config as config_lib
from acl_jax import parallel
from acl_jax import run_dir
from acl_jax import train

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in a child process, since the device count is fixed when JAX starts: the same tiny
# ACL fine-tune on 1 device, on 8 with parameters and optimizer state sharded, and on 8 in
# micro-batches; then a batch size that 8 devices cannot split, and micro-batches that cannot.
# (8 devices with the state replicated: the two-host test.)
_CHILD = r"""
import json, pathlib, sys
import jax, numpy as np
from acl_jax import run_dir, train
from tests.conftest import tiny_run_config

model_dir, glue_dir, tmp = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
assert jax.device_count() == 8, jax.devices()
report = {}
for name, devices, fields in (("one", 1, {}), ("sharded", 8, {"shard_params": True}),
                              ("microbatched", 8, {"microbatch_size": 8})):
  workdir = tmp / name
  config = tiny_run_config(model_dir, glue_dir, objective="acl", num_devices=devices,
                           batch_size=16, max_steps=4, log_every=1, eval_every=4, **fields)
  results = train.train_and_evaluate(config, workdir)
  params, _ = run_dir.load_params(workdir)
  np.savez(tmp / f"{name}.npz", **{"/".join(map(str, k)): np.asarray(v) for k, v in
                                   jax.tree_util.tree_flatten_with_path(params)[0]})
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  report[name] = {"losses": [r["loss"] for r in rows if "loss" in r],
                  "ce": [r["ce"] for r in rows if "ce" in r],
                  "kept": [r["kept"] for r in rows if "kept" in r],
                  "dev": results["final"]["validation"],
                  "mesh": json.loads((workdir / "config.json").read_text())["meta"]["mesh"]}
config = tiny_run_config(model_dir, glue_dir, objective="ce", batch_size=12, max_steps=1)
try:
  train.train_and_evaluate(config, tmp / "indivisible")
  report["indivisible"] = None
except ValueError as e:
  report["indivisible"] = str(e)
config = tiny_run_config(model_dir, glue_dir, objective="acl", batch_size=16, microbatch_size=4,
                         max_steps=1)
try:
  train.train_and_evaluate(config, tmp / "micro_indivisible")
  report["micro_indivisible"] = None
except ValueError as e:
  report["micro_indivisible"] = str(e)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def eight_device_report(tiny_bert_dir, glue_dir, tmp_path_factory):
  tmp = tmp_path_factory.mktemp("parallel")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_bert_dir), str(glue_dir),
                         str(tmp)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("REPORT "))
  report = json.loads(line[len("REPORT "):])
  params = {name: dict(np.load(tmp / f"{name}.npz"))
            for name in ("one", "sharded", "microbatched")}
  return report, params


# Sharded parameters; micro-batches of 8 (each spread over the 8 devices) with the gate and
# the contrastive terms on the whole batch of 16.
@pytest.mark.parametrize("name", ["sharded", "microbatched"])
def test_eight_devices_train_like_one(eight_device_report, name):
  report, params = eight_device_report
  one, many = report["one"], report[name]
  assert one["mesh"]["devices"] == 1 and many["mesh"]["devices"] == 8
  assert many["mesh"]["shard_params"] == (name == "sharded")
  assert len(one["losses"]) == 4
  np.testing.assert_allclose(many["losses"], one["losses"], rtol=0, atol=1e-5)
  np.testing.assert_allclose(many["ce"], one["ce"], rtol=0, atol=1e-5)
  assert many["kept"] == one["kept"]  # the gate decided the same way on every step
  assert params[name].keys() == params["one"].keys()
  for key, reference in params["one"].items():
    np.testing.assert_allclose(params[name][key], reference, rtol=0, atol=1e-5, err_msg=key)


def test_dev_metric_is_the_same_on_one_and_eight_devices(eight_device_report):
  # RTE dev has 277 examples: the padded last batch must count each exactly once on 8 devices.
  report, _ = eight_device_report
  assert report["sharded"]["dev"] == pytest.approx(report["one"]["dev"], abs=1e-9)


def test_a_batch_that_does_not_split_over_the_devices_is_refused(eight_device_report):
  message = eight_device_report[0]["indivisible"]
  assert message is not None
  assert "batch_size=12" in message and "8 devices" in message and "multiple of 8" in message
  message = eight_device_report[0]["micro_indivisible"]
  assert message is not None
  assert "microbatch_size=4" in message and "8 devices" in message


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1"}, True),
    ({"SLURM_NTASKS": "4", "ACL_JAX_DISTRIBUTED": "0"}, False),
    ({"ACL_JAX_DISTRIBUTED": "1"}, True),
])
def test_multi_host_detection_reads_the_environment(environ, expected):
  assert parallel.wants_distributed(environ) is expected


def test_sharded_state_splits_large_tensors_on_a_divisible_axis():
  mesh = parallel.make_mesh(1)
  tree = {"embedding": np.zeros((30522, 32)), "bias": np.zeros(32), "kernel": np.zeros((7, 4096))}
  specs = {k: s.spec for k, s in parallel.state_sharding(tree, mesh, shard_params=True).items()}
  # One device divides everything: the largest axis is split.
  assert specs == {"embedding": jax.sharding.PartitionSpec("data", None),
                   "bias": jax.sharding.PartitionSpec(),
                   "kernel": jax.sharding.PartitionSpec(None, "data")}
  replicated = parallel.state_sharding(tree, mesh, shard_params=False)
  assert all(s.spec == jax.sharding.PartitionSpec() for s in replicated.values())


def test_too_many_devices_is_a_clear_error():
  with pytest.raises(ValueError, match=r"num_devices=99: this job has \d+ devices"):
    parallel.make_mesh(99)


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def test_two_hosts_run_the_same_command_and_train_like_one_device(tiny_bert_dir, glue_dir,
                                                                  tmp_path):
  """Two processes of 4 CPU devices each join one job from the environment, as two hosts of a
  pod would, and run the same CLI command: each feeds its own half of every batch, both take
  part in the checkpoint saves, process 0 alone writes the run files. The result equals a
  single-device run of the same config."""
  preset = "objective=acl,max_steps=4,batch_size=16,max_length=64,eval_every=4"
  workdir = tmp_path / "two_hosts"
  command = [sys.executable, "-m", "acl_jax.main",
             f"--config=configs/glue.py:rte,model={tiny_bert_dir},{preset}",
             "--config.log_every=1", f"--workdir={workdir}"]
  port = _free_port()
  procs, logs = [], []
  for process_id in range(2):
    env = dict(os.environ, GLUE_DIR=str(glue_dir), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(process_id))
    logs.append(open(tmp_path / f"host{process_id}.log", "w"))
    procs.append(subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=logs[-1],
                                  stderr=subprocess.STDOUT))
  for proc in procs:
    proc.wait(timeout=900)
  for process_id, proc in enumerate(procs):
    logs[process_id].close()
    assert proc.returncode == 0, (tmp_path / f"host{process_id}.log").read_text()[-5000:]

  meta = json.loads((workdir / "config.json").read_text())["meta"]
  assert meta["mesh"] == {"devices": 8, "processes": 2, "shard_params": False}
  config = config_lib.get_config(f"rte,model={tiny_bert_dir},{preset}")
  config.log_every = 1
  config.data.glue_dir = str(glue_dir)
  reference = train.train_and_evaluate(config, tmp_path / "one_device")

  rows = lambda d: [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
  ours, theirs = rows(workdir), rows(tmp_path / "one_device")
  assert [r["step"] for r in ours] == [r["step"] for r in theirs]  # written once, by process 0
  for mine, ref in zip(ours, theirs):
    for key in ("loss", "ce", "aux", "kept"):
      if key in ref:
        assert mine[key] == pytest.approx(ref[key], abs=1e-5), (mine["step"], key)
  results = json.loads((workdir / "eval_results.json").read_text())
  assert results["final"]["validation"] == pytest.approx(reference["final"]["validation"],
                                                         abs=1e-9)
  params, step = run_dir.load_params(workdir)
  ref_params, _ = run_dir.load_params(tmp_path / "one_device")
  assert step == 4
  for path, value in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
    mine = params
    for key in path:
      mine = mine[key.key]
    np.testing.assert_allclose(np.asarray(mine), np.asarray(value), rtol=0, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
