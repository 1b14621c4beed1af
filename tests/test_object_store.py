"""--workdir=gs://...: every mode against a GCS server running in this process (the
gcp-storage-emulator package; no network): gcsfs (epath's GCS backend) and tensorstore
(orbax's arrays) are pointed at it by their documented environment variables."""

import io
import json
import os
import socket
import struct
import subprocess
import sys
import zipfile

from etils import epath
import jax
import numpy as np
import pytest

from acl_jax import early_exit
from acl_jax import run_dir
from acl_jax import submission
from acl_jax import train
from conftest import (REPO_ROOT, tensorboard_scalars, tiny_run_config,
                      train_until_crash_after_save)

BUCKET = "acl-jax-test"
PRESET = "rte,multi_exit,objective=acl_cl,max_steps=6,checkpoint_every=2,eval_every=6"


def _send_generation_headers_on_download():
  """Real GCS answers a media download with the object's x-goog-generation; the emulator does
  not, so tensorstore reads generation 0 and refuses its next conditional write of that object
  (orbax's OCDBT manifest) as "Malformed StorageGeneration". Add the headers to its handler."""
  from gcp_storage_emulator import server
  from gcp_storage_emulator.exceptions import NotFound
  from gcp_storage_emulator.handlers import objects
  original = objects.download

  def download(request, response, storage, *args, **kwargs):
    original(request, response, storage, *args, **kwargs)
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
      return
    response["x-goog-generation"] = obj["generation"]
    response["x-goog-metageneration"] = obj["metageneration"]
  objects.download = download  # the JSON API's GET ...?alt=media calls it by name
  for _, handlers in server.HANDLERS:
    if handlers.get("GET") is original:
      handlers["GET"] = download
  return original


@pytest.fixture(scope="module")
def gcs_env():
  """A GCS emulator on a free port; the environment variables that send gcsfs and tensorstore
  there (set in this process too, before either first touches gs://)."""
  from gcp_storage_emulator.server import create_server
  _send_generation_headers_on_download()
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  server = create_server("localhost", port, in_memory=True, default_bucket=BUCKET)
  server.start()
  env = {"STORAGE_EMULATOR_HOST": f"http://localhost:{port}",  # gcsfs
         "TENSORSTORE_GCS_HTTP_URL": f"http://localhost:{port}",  # tensorstore
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}  # tensorstore: no credential lookup
  before = {key: os.environ.get(key) for key in env}
  os.environ.update(env)
  yield env
  for key, value in before.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  server.stop()


def _safetensors_contents(blob: bytes):
  """A safetensors file's header (as a dict: its JSON key order varies from process to
  process) and its tensor bytes."""
  size = struct.unpack("<Q", blob[:8])[0]
  return json.loads(blob[8:8 + size]), blob[8 + size:]


def _cli(*flags, glue_dir, env):
  result = subprocess.run(
      [sys.executable, "-m", "acl_jax.main", *flags], cwd=REPO_ROOT, capture_output=True,
      text=True, env={**os.environ, **env, "GLUE_DIR": str(glue_dir), "HF_HUB_OFFLINE": "1",
                      "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_a_gs_workdir_trains_resumes_sweeps_and_exports_like_a_local_one(
    gcs_env, tiny_bert_dir, glue_dir, tmp_path):
  """A multi-exit run in a bucket, crashed after its step-4 save and rerun, ends with the
  local run's params, metrics, evaluations and TensorBoard scalars; then the early_exit,
  export and predict CLIs write the local run's outputs there, and overwrite deletes them."""
  config = tiny_run_config(tiny_bert_dir, glue_dir, PRESET, learning_rate=1e-3)
  reference = train.train_and_evaluate(config, tmp_path / "local")

  # Train into the bucket, crash after the step-4 checkpoint, rerun: it resumes from the
  # bucket to the local run's bits.
  workdir = f"gs://{BUCKET}/runs/rte"
  train_until_crash_after_save(config, workdir, 4)
  results = train.train_and_evaluate(config, workdir)
  assert results["checkpoints"]["resumed_from_step"] == 4
  assert results["history"] == reference["history"]
  params, step = run_dir.load_params(workdir)
  ref_params, _ = run_dir.load_params(tmp_path / "local")
  assert step == 6 and jax.tree.all(jax.tree.map(np.array_equal, params, ref_params))

  remote = epath.Path(workdir)
  timing = ("examples_per_s", "compilations")  # differ between any two runs
  rows = lambda text: [{k: v for k, v in json.loads(line).items() if k not in timing}
                       for line in text.splitlines()]
  assert (rows((remote / run_dir.METRICS_FILE).read_text())
          == rows((tmp_path / "local" / run_dir.METRICS_FILE).read_text()))
  assert json.loads((remote / run_dir.EVAL_RESULTS_FILE).read_text())["history"] == (
      reference["history"])
  assert "orbax" in (remote / run_dir.LOG_FILE).read_text()  # library lines, kept
  # TensorBoard: the events up to the crash's checkpoint and the resumed run's, as locally.
  events = lambda workdir: {tag: values for tag, values in
                            tensorboard_scalars(workdir / run_dir.TENSORBOARD_DIR)[0].items()
                            if tag not in timing}
  assert events(remote) == events(tmp_path / "local")

  # The other modes, as a user runs them, reading and writing the bucket.
  _cli("--mode=early_exit", f"--workdir={workdir}", "--max_examples=8", glue_dir=glue_dir,
       env=gcs_env)
  sweep = json.loads((remote / run_dir.EARLY_EXIT_FILE).read_text())
  assert sweep["workdir"] == workdir and sweep["policies"]
  assert (remote / run_dir.EARLY_EXIT_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  _cli("--mode=export", f"--workdir={workdir}", glue_dir=glue_dir, env=gcs_env)
  local_run = run_dir.load_trained_run(tmp_path / "local")
  local_export = run_dir.write_export(local_run)
  exported = remote / run_dir.EXPORT_DIR
  assert sorted(p.name for p in exported.iterdir()) == sorted(p.name
                                                              for p in local_export.iterdir())
  for name in ("model.safetensors", "exit_heads.safetensors"):
    assert (_safetensors_contents((exported / name).read_bytes())
            == _safetensors_contents((local_export / name).read_bytes())), name
  assert (exported / "config.json").read_text() == (local_export / "config.json").read_text()

  _cli("--mode=predict", f"--workdir={workdir}", "--exit_policy=entropy",
       "--exit_threshold=0.5", glue_dir=glue_dir, env=gcs_env)
  local_files = submission.write_submission(local_run, tmp_path / "submission",
                                            policy=early_exit.Policy("entropy", 0.5))
  remote_submission = remote / run_dir.SUBMISSION_DIR
  for path in local_files:
    assert (remote_submission / path.name).read_bytes() == path.read_bytes(), path.name
  with zipfile.ZipFile(io.BytesIO((remote / run_dir.SUBMISSION_ZIP).read_bytes())) as archive:
    assert sorted(archive.namelist()) == sorted(path.name for path in local_files)

  # overwrite deletes the run's outputs in the bucket.
  config.overwrite = True
  run_dir.prepare_workdir(remote, config)
  assert not (remote / run_dir.CHECKPOINT_DIR).exists()
  assert not (remote / run_dir.METRICS_FILE).exists()
  assert not (remote / run_dir.SUBMISSION_DIR).exists()
