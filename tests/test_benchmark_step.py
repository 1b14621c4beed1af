"""experiments/benchmark_step.py end to end on the tiny shape: rows, ratios, interleaving."""

import json

import pytest

import benchmark_step


@pytest.mark.parametrize("interleave", [True, False])
def test_benchmark_rows_and_ratios(interleave, tmp_path):
  out = tmp_path / "bench.jsonl"
  argv = ["--quick", "--steps", "3", "--out", str(out)]
  if interleave:  # both frameworks, timed in turn
    argv += ["--interleave", "--objectives", "ce,acl"]
  else:
    argv += ["--frameworks", "jax", "--objectives", "ce"]
  rows = benchmark_step.main(argv)
  steps = {(r["framework"], r["objective"]): r for r in rows}
  assert set(steps) == ({("jax", "ce"), ("jax", "acl"), ("pytorch", "ce"), ("pytorch", "acl")}
                        if interleave else {("jax", "ce")})
  for row in rows:
    assert row["interleaved"] is interleave
    assert len(row["step_times_s"]) == 3 and min(row["step_times_s"]) > 0
    assert row["median_step_s"] == sorted(row["step_times_s"])[1]
    assert ("pipelined_step_s" in row) is not interleave
    if row["framework"] == "jax":  # the state it takes holds at least the word embeddings
      assert row["xla_peak_mib"] == pytest.approx(  # and their two Adam moments, in float32
          row["xla_argument_mib"] + row["xla_output_mib"] + row["xla_temp_mib"])
      assert row["xla_argument_mib"] > 3 * 4 * row["vocab_size"] * row["hidden_size"] / 2**20
      assert row["xla_temp_mib"] > 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  ratios = {r["name"]: r for r in lines if r["kind"] == "ratio"}
  assert len(lines) == len(rows) + len(ratios)
  if not interleave:
    return
  assert steps[("jax", "acl")]["kept"] in (0.0, 1.0)  # the gate ran and decided
  acl = ratios["jax acl / jax ce"]
  assert acl["ratio"] == pytest.approx(steps[("jax", "acl")]["median_step_s"]
                                       / steps[("jax", "ce")]["median_step_s"])
  assert acl["meets_target"] == (acl["ratio"] <= 1.55)
  assert ratios["jax acl / pytorch acl"]["ratio"] == pytest.approx(
      steps[("jax", "acl")]["median_step_s"] / steps[("pytorch", "acl")]["median_step_s"])


def test_the_torch_acl_embed_port_matches_ours():
  assert benchmark_step.check_torch_acl_embed() < 1e-5
