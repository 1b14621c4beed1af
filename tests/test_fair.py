"""experiments/fair.py and fair_report.py: the fair comparison's choices, next commands, tables
and answers, from records written here as run_grid keeps them (config.json, eval_results.json)."""

import collections
import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
from scipy import stats

import fair
import fair_report
import run_grid

FAIR_1 = fair.COMPARISONS["fair-1"]
COMMIT, MACHINE = "5eb4784f7ffe", "AMD EPYC, 2 cores"  # as acl_jax.host.machine() writes it
CPU = "4202c509659cc6d0"  # acl_jax.host.cpu_fingerprint(): the model name and feature flags


def write_record(root: pathlib.Path, task, objective, seed, score, *, lr=1e-4, aux=0.5,
                 temperature=0.3, multi_exit=False, gate="per_exit", commit=COMMIT,
                 cpu=CPU, early_exit=None) -> None:
  name = f"{task}_{objective}_s{seed}_lr{lr}_a{aux}_t{temperature}_{multi_exit}_{gate}"
  path = root / name
  path.mkdir(parents=True)
  metric = {"rte": "accuracy", "mrpc": "f1", "cola": "mcc"}[task]
  config = {"task": task, "model": "minilm", "objective": objective, "multi_exit": multi_exit,
            "learning_rate": lr, "num_epochs": 3, "max_steps": 0, "batch_size": 32,
            "seed": seed, "aux_weight": aux, "temperature": temperature, "cl_weight": 0.5,
            "gate_granularity": gate, "pooler_input": "mean" if multi_exit else "cls"}
  # As fair-1's records name the CPU: by their automatic compilation cache directory.
  meta = {"argv": ["acl_jax/main.py"], "git_commit": commit, "machine": MACHINE,
          "compilation_cache": f"/work/fair_runs/cache/xla/{cpu}", "backend": "cpu",
          "versions": {}}
  (path / "config.json").write_text(json.dumps({"config": config, "meta": meta}))
  main = f"validation/avg/{metric}" if multi_exit else f"validation/{metric}"
  final = ({"validation": {f"exit1/{metric}": score / 2, f"avg/{metric}": score}}
           if multi_exit else {"validation": {metric: score}})
  (path / "eval_results.json").write_text(json.dumps({
      "final": {"step": 10, **final}, "main_metric": main,
      "train": {"seconds": 1.0, "examples_per_s": 1.0, "steps": 10}}))
  if early_exit is not None:
    (path / "early_exit.json").write_text(json.dumps(early_exit))


def selection(root, task="rte", ce=(0.6, 0.7, 0.7), scl=None, acl=None):
  """Seed-0 records: CE at each learning rate; CE+SCL and ACL over λ x τ at 1e-4 with the
  given {(λ, τ): score} (every other point scoring 0.5)."""
  for lr, score in zip(fair.LEARNING_RATES, ce):
    write_record(root, task, "ce", 0, score, lr=lr)
  for objective, best in (("scl", scl), ("acl", acl)):
    if best is None:
      continue
    for aux in fair.AUX_WEIGHTS:
      for temperature in fair.TEMPERATURES:
        write_record(root, task, objective, 0, best.get((aux, temperature), 0.5), lr=1e-4,
                     aux=aux, temperature=temperature)


def test_a_choice_waits_for_its_whole_grid_and_breaks_ties_by_the_listed_order(tmp_path):
  selection(tmp_path, ce=(0.6, 0.7, 0.7))
  runs = fair.read_records(tmp_path)
  chosen, missing = fair.choose(runs, "rte", "ce", {"learning_rate": fair.LEARNING_RATES})
  assert chosen == {"learning_rate": 1e-4} and missing == []  # 1e-4 and 2e-4 tie: 1e-4 first
  for path in tmp_path.glob("rte_ce_s0_lr0.0002*"):
    (path / "eval_results.json").unlink()
  chosen, missing = fair.choose(fair.read_records(tmp_path), "rte", "ce",
                                {"learning_rate": fair.LEARNING_RATES})
  assert chosen is None and missing == [{"learning_rate": 2e-4}]


def test_each_stage_is_planned_once_the_choices_it_needs_are_made(tmp_path):
  selection(tmp_path, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9, (0.1, 0.1): 0.9})
  runs = fair.read_records(tmp_path)
  chosen = fair.choices(runs)
  assert chosen["rte"] == {"ce": {"learning_rate": 1e-4},
                           "scl": {"learning_rate": 1e-4, "aux_weight": 0.3, "temperature": 0.1},
                           "acl": {"learning_rate": 1e-4, "aux_weight": 0.1, "temperature": 0.1}}
  assert chosen["mrpc"] == {"ce": None, "scl": None, "acl": None}
  commands = [" ".join(c) for c in fair.next_commands(runs, tmp_path / "fair_1", FAIR_1)]
  mrpc = [c for c in commands if "--tasks mrpc" in c]
  assert len(mrpc) == 1 and "--grid learning_rate=5e-05,0.0001,0.0002" in mrpc[0]
  rte = [c for c in commands if "--tasks rte" in c]
  grid = next(c for c in rte if "--objectives scl,acl" in c)
  assert ("--seeds 0" in grid and "--grid aux_weight=0.1,0.3,0.5,0.9" in grid
          and "--grid temperature=0.1,0.3,0.5,0.7" in grid and "learning_rate=0.0001 " in grid)
  report = next(c for c in rte if "--objectives acl,acl_embed" in c)
  assert ("--seeds 1,2,3" in report and "fair_1_report" in report
          and "--grid aux_weight=0.1 --grid temperature=0.1" in report)
  deebert = next(c for c in rte if "--objectives deebert" in c)
  assert "pooler_weights=per_exit" in deebert and "--early_exit --early_exit_examples 128" in deebert
  ablation = next(c for c in rte if "gate_granularity=global" in c)
  assert ("--objectives acl_cl" in ablation and "fair_1_multi_exit" in ablation
          and "--study fair_1_multi_exit_global_gate" in ablation)
  pilot = [c for c in rte if "measure_conflict,log_every=1" in c]
  assert len(pilot) == 2 and all("fair_1_pilot" in c and "--seeds 0 " in c for c in pilot)
  assert "--objectives scl" in pilot[0] and "--grid aux_weight=0.3 --grid temperature=0.1" in pilot[0]


def test_no_two_commands_share_a_study_over_other_axes(tmp_path):
  """run_grid refuses a command whose --grid axes differ from its study's trials (a worker would
  run the other command's queued points at its own values): the plan never asks for that."""
  selection(tmp_path, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
  studies = {}
  for command in fair.next_commands(fair.read_records(tmp_path), tmp_path / "fair_1",
                                    FAIR_1):
    args = run_grid.parse_args(command[1:])
    root = args.root
    for cell in run_grid.make_cells(args, root):
      axes = studies.setdefault((root, cell.study_name), set(cell.distributions))
      assert axes == set(cell.distributions), (cell.study_name, " ".join(command))
  assert (tmp_path / "fair_1_multi_exit", "fair_1_multi_exit_global_gate/rte/acl_cl") in studies


def test_each_comparison_plans_from_and_records_into_its_own_directories(
    tmp_path, monkeypatch, capsys):
  """`plan --comparison fair-2` reads fair-2's records alone and sends every run's record to
  fair-2's directories: fair-1's choices and records never reach it."""
  fair_2 = fair.Comparison("fair-2", "0" * 40, records=tmp_path / "records")
  monkeypatch.setitem(fair.COMPARISONS, "fair-2", fair_2)
  assert [d.name for d in (fair_2.single_records, fair_2.multi_records,
                           fair_2.pilot_records)] == ["fair_2", "fair_2_multi_exit", "fair_2_pilot"]
  selection(fair_2.single_records, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
  selection(tmp_path / "records" / "fair_1", "mrpc")  # fair-1's: MRPC's CE chosen there
  fair.main(["plan", "--comparison", "fair-2", "--root", str(tmp_path / "runs" / "fair_2")])
  out = capsys.readouterr().out
  assert "rte: ce: learning_rate=0.0001; scl: learning_rate=0.0001" in out
  assert "mrpc: ce: not yet" in out
  commands = [line.split("] ", 1)[1].split() for line in out.splitlines() if "run_grid.py" in line]
  records = {c[c.index("--records") + 1] for c in commands}
  assert records == {str(d) for d in (fair_2.single_records, fair_2.multi_records,
                                      fair_2.pilot_records)}
  roots = {pathlib.Path(c[c.index("--root") + 1]).name for c in commands}
  assert roots == {"fair_2", "fair_2_report", "fair_2_multi_exit", "fair_2_pilot"}
  assert not any("fair_1" in " ".join(c) for c in commands)


def test_the_single_exit_table_compares_each_objective_with_ce(tmp_path):
  selection(tmp_path, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
  ce, acl = [0.60, 0.62, 0.61], [0.66, 0.70, 0.65]
  for seed, (c, a) in enumerate(zip(ce, acl), 1):
    write_record(tmp_path, "rte", "ce", seed, c)
    write_record(tmp_path, "rte", "acl", seed, a, aux=0.9, temperature=0.5)
    write_record(tmp_path, "rte", "acl_embed", seed, a - 0.01, aux=0.9, temperature=0.5)
    write_record(tmp_path, "rte", "acl", seed, 0.99, aux=0.5, temperature=0.3)  # not chosen
  text, rows = fair_report.single_exit_table(fair.read_records(tmp_path))
  assert sorted((r["objective"], r["seed"]) for r in rows) == sorted(
      (o, s) for o in ("ce", "acl", "acl_embed") for s in (1, 2, 3))
  assert all(r["commit"] == COMMIT for r in rows)
  acl_line = next(line for line in text.splitlines() if "| rte | acl |" in line)
  # Welch's t-test written out: t with the Welch-Satterthwaite degrees of freedom.
  va, vb = np.var(acl, ddof=1) / 3, np.var(ce, ddof=1) / 3
  t = (np.mean(acl) - np.mean(ce)) / math.sqrt(va + vb)
  df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
  assert f"| {2 * stats.t.sf(abs(t), df):.3f} |" in acl_line
  assert f"| {np.mean(acl) - np.mean(ce):+.4f} |" in acl_line
  assert "| 0.0001, 0.9, 0.5 |" in acl_line and "| 1,2,3 |" in acl_line
  assert "| rte | scl | 0.0001, 0.3, 0.1 | - | missing |" in text
  assert "| mrpc | ce | not chosen yet |" in text


def test_welch_p_is_scipys_and_takes_a_group_without_spread():
  rng = np.random.default_rng(0)
  for n, m in ((3, 3), (3, 5), (8, 4)):
    a, b = rng.normal(0.6, 0.02, n), rng.normal(0.62, 0.05, m)
    assert fair_report.welch_p(a, b) == pytest.approx(
        stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
  # One group without spread: t over the other's standard error, with its n - 1 degrees.
  a, b = [0.6, 0.6, 0.6], [0.62, 0.64, 0.63]
  t = (0.63 - 0.6) / (np.std(b, ddof=1) / math.sqrt(3))
  assert fair_report.welch_p(a, b) == pytest.approx(2 * stats.t.sf(t, 2))
  assert math.isnan(fair_report.welch_p([0.6] * 3, [0.6] * 3))
  assert math.isnan(fair_report.welch_p([0.6], [0.6, 0.7]))


def test_the_bootstrap_interval_brackets_the_observed_difference():
  a, b = [0.66, 0.70, 0.65], [0.60, 0.62, 0.61]
  low, high = fair_report.bootstrap_interval(a, b)
  # Resampled means stay within each group's range: the difference too.
  assert min(a) - max(b) <= low < np.mean(a) - np.mean(b) < high <= max(a) - min(b)
  assert fair_report.bootstrap_interval(a, b) == (low, high)  # seeded: the table is reproducible


def test_the_multi_exit_table_reads_the_best_metric_at_each_counted_speedup(tmp_path):
  selection(tmp_path / "single", "rte", scl={}, acl={(0.9, 0.5): 0.9})
  sweep = lambda *points: {"policies": {"entropy": [
      {"speedup_ratio": r, "metrics": {"accuracy": m}} for r, m in points]}}
  for seed, best in zip((1, 2, 3), (0.60, 0.62, 0.64)):
    write_record(tmp_path / "multi", "rte", "acl_cl", seed, 0.7, aux=0.9, temperature=0.5,
                 multi_exit=True, early_exit=sweep((1.0, 0.7), (1.6, best), (2.1, 0.55)))
  text, rows = fair_report.multi_exit_table(fair.read_records(tmp_path / "multi"),
                                     fair.read_records(tmp_path / "single"))
  line = next(line for line in text.splitlines() if "| rte | acl_cl |" in line)
  assert line == "| rte | acl_cl | 1,2,3 | 0.6200 ± 0.0200 | 0.5500 ± 0.0000 | 0.7000 ± 0.0000 |"
  assert len(rows) == 3 and rows[0]["gate_granularity"] == "per_exit"
  assert "| rte | acl_cl (global gate) | - |" in text


def test_one_comparison_keeps_one_commit_and_one_machine(tmp_path):
  write_record(tmp_path / "commits", "rte", "ce", 1, 0.6)
  write_record(tmp_path / "commits", "rte", "ce", 2, 0.6, commit="0123456789ab")
  with pytest.raises(SystemExit, match="mix commits"):
    fair.check_one_commit_and_machine(fair.read_records(tmp_path / "commits"))
  # One model name is not one machine type: the feature flags must match too.
  write_record(tmp_path / "cpus", "rte", "ce", 1, 0.6)
  write_record(tmp_path / "cpus", "rte", "ce", 2, 0.6, cpu="e51468c5bac4503e")
  with pytest.raises(SystemExit, match="mix cpus: {'4202c509659cc6d0': 1, 'e51468c5bac4503e': 1}"):
    fair.check_one_commit_and_machine(fair.read_records(tmp_path / "cpus"))


def test_a_session_on_another_machine_type_adds_no_runs(tmp_path):
  write_record(tmp_path, "rte", "ce", 0, 0.6)
  runs = fair.read_records(tmp_path)
  fair.check_this_machine(runs, MACHINE, CPU, "fair-1")
  fair.check_this_machine([], "Intel(R) Xeon(R) Processor, 2 cores", "0" * 16,  # the first
                          "fair-1")                                             # decides
  with pytest.raises(SystemExit, match="this machine is 'Intel.*come from 'AMD EPYC, 2 cores'"):
    fair.check_this_machine(runs, "Intel(R) Xeon(R) Processor, 2 cores", CPU, "fair-1")
  with pytest.raises(SystemExit, match=(
      "this machine is 'AMD EPYC, 2 cores' with CPU fingerprint e51468c5bac4503e, and the "
      "records of fair-1 come from 'AMD EPYC, 2 cores' with CPU fingerprint 4202c509659cc6d0.*"
      r"the comparison of this one \(--comparison; fair-1, fair-2, fair-3, fair-4, fair-5\)")):
    fair.check_this_machine(runs, MACHINE, "e51468c5bac4503e", "fair-1")


def test_a_run_directory_from_another_machine_type_is_refused(tmp_path):
  """A partial run another type started (config.json only) would be resumed, a finished one
  recorded: `run` refuses both, in any of the four roots, naming each."""
  root = tmp_path / "fair_1"
  roots = fair.run_roots(root)
  assert [r.name for r in roots] == ["fair_1", "fair_1_report", "fair_1_multi_exit",
                                     "fair_1_pilot"]
  write_record(root, "rte", "ce", 0, 0.6)  # this type's, finished
  write_record(roots[2], "rte", "ce", 1, 0.6, multi_exit=True, cpu="e51468c5bac4503e")
  (roots[2] / "study.db").write_bytes(b"")  # not a run directory
  started = roots[3] / "rte_scl_s0"
  started.mkdir(parents=True)
  (started / "config.json").write_text(json.dumps(
      {"config": {}, "meta": {"cpu": "e51468c5bac4503e"}}))
  fair.check_run_directories(fair.run_roots(tmp_path / "elsewhere"), CPU)  # no roots yet
  with pytest.raises(SystemExit, match=r"rte_ce_s1\S* \(e51468c5bac4503e\), \S*rte_scl_s0 "
                     r"\(e51468c5bac4503e\); move their roots aside") as refused:
    fair.check_run_directories(roots, CPU)
  assert "rte_ce_s0" not in str(refused.value)
  for path in (roots[2], started):
    shutil.rmtree(path)
  fair.check_run_directories(roots, CPU)
  with pytest.raises(SystemExit, match=r"rte_ce_s0\S* \(4202c509659cc6d0\)"):
    fair.check_run_directories(roots, "e51468c5bac4503e")


@pytest.mark.parametrize("tag", fair.COMPARISONS)
def test_the_committed_records_of_a_comparison_name_one_cpu_and_its_commit(tag):
  """Each comparison's records name one CPU (fair-1's only by their compilation cache
  directory), and the commit the comparison pins."""
  comparison = fair.COMPARISONS[tag]
  runs = [run for records in comparison.read() for run in records]
  assert runs or tag != "fair-1"
  assert all(run["cpu"] is not None and run["commit"] == comparison.commit for run in runs)
  fair.check_one_commit_and_machine(runs)


def test_runs_two_comparisons_both_recorded_are_compared_evaluation_by_evaluation(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  for root in (a, b):
    write_record(root, "rte", "ce", 0, 0.6)
    write_record(root, "mrpc", "ce", 0, 0.8)
  write_record(a, "cola", "ce", 0, 0.30)
  write_record(b, "cola", "ce", 0, 0.25)
  write_record(b, "rte", "acl", 1, 0.7)  # recorded by one comparison only
  # The same final score after another evaluation during training.
  results = next(b.glob("mrpc_ce_*")) / "eval_results.json"
  logged = json.loads(results.read_text())
  results.write_text(json.dumps({**logged, "history": [{"step": 5, "validation": {"f1": 0.7}}]}))

  agreement = fair_report.same_runs_agreement(fair.read_records(a), fair.read_records(b))
  assert agreement == {"runs": 3, "evaluations_equal": 1, "final_equal": 2,
                       "largest_final_difference": pytest.approx(0.05)}
  assert fair_report.same_runs_agreement(fair.read_records(a), [])["runs"] == 0


def test_runs_execute_only_the_tagged_commit(tmp_path):
  git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True,
                                  capture_output=True, text=True)
  git("init", "-q")
  (tmp_path / "f").write_text("a")
  git("add", "f")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
  comparison = fair.Comparison("fair-9", git("rev-parse", "HEAD").stdout.strip())
  fair.check_pinned_commit(tmp_path, comparison)
  (tmp_path / "f").write_text("b")
  with pytest.raises(SystemExit, match="has changes to fair-9's files"):
    fair.check_pinned_commit(tmp_path, comparison)
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "b")
  with pytest.raises(SystemExit, match=f"fair-9's runs execute {comparison.commit[:12]}; .* "
                     "git worktree add --detach ../fair9"):
    fair.check_pinned_commit(tmp_path, comparison)


def commit_all(checkout: pathlib.Path) -> str:
  """Commits every file under `checkout` to a new repository there; returns the commit."""
  git = lambda *a: subprocess.run(["git", "-C", str(checkout), *a], check=True,
                                  capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  git("add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
  return git("rev-parse", "HEAD")


@pytest.mark.parametrize("run_grid_exit", [fair.PREEMPTED, 1])
def test_run_exits_75_when_a_run_is_stopped_and_1_naming_the_commands_whose_runs_failed(
    tmp_path, monkeypatch, run_grid_exit):
  """`fair.py run` end to end, with a checkout whose run_grid.py exits as a stopped (75) or a
  failed (1) command does."""
  checkout = tmp_path / "checkout"
  (checkout / "experiments").mkdir(parents=True)
  fake_run_grid = f"import sys\nsys.exit({run_grid_exit})\n"
  (checkout / "experiments" / "run_grid.py").write_text(fake_run_grid)
  # No records yet: any machine.
  monkeypatch.setitem(fair.COMPARISONS, "fair-1", fair.Comparison(
      "fair-1", commit_all(checkout), records=tmp_path / "records"))
  previous = signal.getsignal(signal.SIGTERM)  # main passes SIGTERM on to its children
  try:
    with pytest.raises(SystemExit) as stopped:
      fair.main(["run", "--root", str(tmp_path / "fair_1"), "--checkout", str(checkout)])
  finally:
    signal.signal(signal.SIGTERM, previous)
  if run_grid_exit == fair.PREEMPTED:
    assert stopped.value.code == fair.PREEMPTED
  else:  # each of CE's three learning-rate commands ran and failed; the message names them
    assert "3 run_grid commands had failed runs" in stopped.value.code
    assert all(f"--tasks {task} " in stopped.value.code for task in fair.TASKS)


@pytest.mark.parametrize("train_exit", [0, fair.PREEMPTED])
def test_run_finishes_the_runs_a_stop_left_part_way_before_their_command_and_the_others_go_on(
    tmp_path, monkeypatch, train_exit):
  """`fair.py run` end to end with a fake checkout: the one point with a checkpoint in its run
  directory is trained first, as run_grid would (the checkout's `python -m acl_jax.main`, its
  output appended to the run's log.txt), and recorded before its command's run_grid starts,
  while the other lane runs another task's command. A resumed run stopped again stops `run`
  (exit 75) and its command never starts."""
  checkout, records, root = tmp_path / "checkout", tmp_path / "records", tmp_path / "fair_1"
  write_record(tmp_path / "template", "rte", "ce", 0, 0.6, lr=1e-4)
  (template,) = (tmp_path / "template").iterdir()
  (checkout / "acl_jax").mkdir(parents=True)
  (checkout / "experiments").mkdir()
  (checkout / "acl_jax" / "__init__.py").write_text("")
  started = tmp_path / "run_grid"  # each run_grid writes its task, and whether the record was in
  (checkout / "acl_jax" / "main.py").write_text(
      "import pathlib, shutil, sys, time\n"
      "workdir = pathlib.Path(sys.argv[-1].removeprefix('--workdir='))\n"
      "print('fake training', sys.argv[1])\n"
      # Trains until the other lane has started a run_grid (20 s at most): side by side.
      "for _ in range(400):\n"
      f"  if pathlib.Path({str(started)!r}).exists(): break\n"
      "  time.sleep(0.05)\n"
      f"side_by_side = pathlib.Path({str(started)!r}).exists()\n"
      f"with open({str(tmp_path / 'trained')!r}, 'a') as f:\n"
      "  f.write(f'{workdir.name} {side_by_side}\\n')\n"
      f"if {train_exit}: sys.exit({train_exit})\n"
      f"for name in ('config.json', 'eval_results.json'):\n"
      f"  shutil.copy({str(template)!r} + '/' + name, workdir / name)\n")
  resumed = "rte_ce_s0_learning_rate=0.0001"
  (checkout / "experiments" / "run_grid.py").write_text(
      f"import os, sys\nwith open({str(started)!r}, 'a') as f:\n"
      f"  f.write(sys.argv[sys.argv.index('--tasks') + 1] + ' ' + "
      f"str(os.path.exists({str(records / 'fair_1' / resumed / 'eval_results.json')!r})) + "
      "'\\n')\n")
  monkeypatch.setitem(fair.COMPARISONS, "fair-1", fair.Comparison(
      "fair-1", commit_all(checkout), records=records))
  (root / resumed / "checkpoints").mkdir(parents=True)
  (root / "rte_ce_s0_learning_rate=5e-05").mkdir()  # started, nothing saved: not resumed
  previous = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(SystemExit) if train_exit else contextlib.nullcontext() as stopped:
      fair.main(["run", "--root", str(root), "--checkout", str(checkout)])
  finally:
    signal.signal(signal.SIGTERM, previous)
  # It trained, and the other lane started another task's run_grid meanwhile.
  assert (tmp_path / "trained").read_text() == resumed + " True\n"
  log = (root / resumed / "log.txt").read_text()
  assert "fake training --config=configs/glue.py:rte,model=minilm,objective=ce,seed=0," in log
  grids = started.read_text().splitlines()
  if train_exit:
    assert stopped.value.code == fair.PREEMPTED
    assert not (records / "fair_1").exists() and not any(g.startswith("rte") for g in grids)
  else:
    kept = records / "fair_1" / resumed
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "eval_results.json",
                                                      "log.txt"]
    assert set(g for g in grids if g.startswith("rte")) == {"rte True"}  # recorded before


def report(root, task, scores: dict[str, list[float]], *, scl_point=(0.3, 0.1),
           acl_point=(0.9, 0.5)) -> None:
  """Seeds 1-3 of each single-exit objective at the points `selection` makes best."""
  points = {"ce": (0.5, 0.3), "scl": scl_point, "acl": acl_point, "acl_embed": acl_point}
  for objective, values in scores.items():
    for seed, value in enumerate(values, 1):
      aux, temperature = points[objective]
      write_record(root, task, objective, seed, value, aux=aux, temperature=temperature)


def test_the_answers_wait_for_every_cell_then_give_each_task_its_verdict(tmp_path):
  same = [0.60, 0.62, 0.61]
  scores = {  # RTE: ACL clearly above CE and CE+SCL; MRPC: noise; CoLA: ACL clearly below CE.
      "rte": {"ce": same, "scl": same, "acl_embed": [0.70, 0.71, 0.72],
              "acl": [0.70, 0.71, 0.72]},
      "mrpc": {"ce": same, "scl": same, "acl_embed": same, "acl": [0.61, 0.60, 0.62]},
      "cola": {"ce": same, "scl": [0.50, 0.51, 0.52], "acl_embed": same,
               "acl": [0.50, 0.51, 0.52]}}
  for task, by_objective in scores.items():
    selection(tmp_path, task, scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
    report(tmp_path, task, by_objective)
  drop = tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.startswith("cola_acl_s3"))
  hidden = tmp_path.parent / "hidden"
  drop.rename(hidden)
  text = fair_report.answers(fair.read_records(tmp_path), [])
  assert "**ACL against CE and CE+SCL.** Not answered yet: 11 of 12 cells have their 3 report " \
         "seeds (35 of 36 runs recorded" in text
  hidden.rename(drop)
  single = fair.read_records(tmp_path)
  text = fair_report.answers(single, [])
  assert ("Against CE, ACL is significantly higher on RTE, significantly lower on CoLA, and not "
          "significantly different on MRPC. Against CE+SCL it is significantly higher on RTE, "
          "significantly lower on none, and not significantly different on MRPC and CoLA."
          ) in text
  rte = next(line for line in text.splitlines() if line.startswith("- RTE accuracy"))
  p = stats.ttest_ind([0.70, 0.71, 0.72], same, equal_var=False).pvalue
  assert f"ACL − CE +0.1000 (Welch p = {p:.3f}" in rte
  # The gate: ACL's scores are ACL-Embed's on RTE and MRPC (reordered), lower on CoLA.
  assert ("ACL against ACL-Embed (the gate's contribution) is significantly higher on none, "
          "significantly lower on CoLA, and not significantly different on RTE and MRPC."
          ) in text
  assert "the pilot has not run on this task yet" in text
  assert "**ACL-CL, the shallow exits and the quality-speed trade-off.** Not answered yet: 0 of " \
         "16 cells" in text
  assert fair_report.summary(single, []).splitlines()[0] == (
      "- **ACL against CE and CE+SCL.** Against CE, ACL is significantly higher on RTE, "
      "significantly lower on CoLA, and not significantly different on MRPC. Against CE+SCL it "
      "is significantly higher on RTE, significantly lower on none, and not significantly "
      "different on MRPC and CoLA.")


def test_the_gate_drop_rate_weights_each_logging_window_by_its_steps(tmp_path):
  write_record(tmp_path, "rte", "acl", 1, 0.6)
  run = fair.read_records(tmp_path)[0]
  rows = [{"step": 20, "conflict_rate": 0.1}, {"step": 40, "conflict_rate": 0.0},
          {"step": 40, "stage": "eval"}, {"step": 50, "conflict_rate": 0.5}]
  (pathlib.Path(run["workdir"]) / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows))
  assert fair_report.gate_drop_rate(run) == pytest.approx((20 * 0.1 + 20 * 0.0 + 10 * 0.5) / 50)


def test_the_multi_exit_answer_compares_acl_cl_with_the_best_other_objective(tmp_path):
  selection(tmp_path / "single", "rte", scl={}, acl={(0.9, 0.5): 0.9})
  sweep = lambda best: {"policies": {"entropy": [
      {"speedup_ratio": 1.0, "metrics": {"accuracy": 0.7}},
      {"speedup_ratio": 2.0, "metrics": {"accuracy": best}}]}}
  at_2x = {"ce": [0.55, 0.56, 0.57], "kd": [0.58, 0.59, 0.60], "deebert": [0.50, 0.52, 0.51],
           "acl": [0.55, 0.55, 0.56], "acl_cl": [0.65, 0.66, 0.64]}
  for objective, values in at_2x.items():
    aux, temperature = (0.9, 0.5) if objective in fair.GATED else (0.5, 0.3)
    for seed, value in enumerate(values, 1):
      write_record(tmp_path / "multi", "rte", objective, seed, 0.7, aux=aux,
                   temperature=temperature, multi_exit=True, early_exit=sweep(value))
  single, multi = (fair.read_records(tmp_path / d) for d in ("single", "multi"))
  _, evidence = fair_report.answer_multi_exit(multi, single)  # unanswered: MRPC, CoLA, the ablation
  assert evidence == []
  cells = fair.multi_exit_runs(multi, single)
  rte = [(o, g, len(runs)) for t, o, g, runs in cells if t == "rte"]
  assert rte == [(o, "per_exit" if o in fair.GATED else None, 3) for o in fair.MULTI_EXIT] + [
      ("acl_cl", "global", 0)]
  runs = {o: r for t, o, g, r in cells if t == "rte" and g != "global"}
  assert fair_report.speedup_scores(runs["acl_cl"], 2.0) == at_2x["acl_cl"]
  # KD is the best other at 2x; ACL-CL's margin over it is what the answer would test.
  c = fair_report.compare(fair_report.speedup_scores(runs["acl_cl"], 2.0), fair_report.speedup_scores(runs["kd"], 2.0))
  assert c["verdict"] == "higher" and c["difference"] == pytest.approx(0.06)


def test_the_tradeoff_figures_draw_each_fully_swept_cell(tmp_path, monkeypatch):
  """One figure per task with a swept cell; a cell with an unswept seed is left out. The sweeps
  are real ones from the committed mean-pooled grid."""
  monkeypatch.setattr(fair_report, "RESULTS", tmp_path / "results")
  (tmp_path / "results").mkdir()
  selection(tmp_path / "single", "rte", scl={}, acl={(0.9, 0.5): 0.9})
  sweeps = fair.RECORDS / "me_minilm_mean"
  sweep = lambda o: json.loads((sweeps / f"rte_{o}_s0" / "early_exit.json").read_text())
  for seed in (1, 2, 3):
    write_record(tmp_path / "multi", "rte", "ce", seed, 0.6, multi_exit=True,
                 early_exit=sweep("ce"))
    for gate in ("per_exit", "global"):
      write_record(tmp_path / "multi", "rte", "acl_cl", seed, 0.6, aux=0.9, temperature=0.5,
                   multi_exit=True, gate=gate, early_exit=sweep("acl_cl"))
    write_record(tmp_path / "multi", "rte", "kd", seed, 0.6, multi_exit=True,
                 early_exit=sweep("ce") if seed < 3 else None)  # seed 3 not swept
  drawn = fair_report.draw_tradeoffs(*(fair.read_records(tmp_path / d) for d in ("multi", "single")),
                                     "fair-1")
  assert drawn == {"rte": ["CE", "ACL-CL", "ACL-CL (global gate)"]}
  assert (tmp_path / "results" / "fair_multi_exit_rte.png").stat().st_size > 10_000


def test_tables_writes_the_chosen_comparisons_tables_and_says_whose(tmp_path, monkeypatch):
  """`tables --comparison fair-2`: fair-2's report runs, one .jsonl line each, in .md tables
  headed by the comparison, its commit and its machine; fair-1's records stay out."""
  monkeypatch.setattr(fair_report, "RESULTS", tmp_path / "results")
  (tmp_path / "results").mkdir()
  fair_2 = fair.Comparison("fair-2", "a" * 40, records=tmp_path / "records")
  monkeypatch.setitem(fair.COMPARISONS, "fair-2", fair_2)
  selection(fair_2.single_records, "rte", scl={(0.3, 0.1): 0.8}, acl={(0.9, 0.5): 0.9})
  report(fair_2.single_records, "rte", {"ce": [0.60, 0.62, 0.61], "acl": [0.66, 0.70, 0.65]})
  report(tmp_path / "records" / "fair_1", "rte", {"ce": [0.1, 0.1, 0.1]})
  fair.main(["tables", "--comparison", "fair-2"])
  text = (tmp_path / "results" / "fair_single_exit.md").read_text()
  assert text.startswith(f"fair-2: commit aaaaaaa, {MACHINE} (CPU fingerprint {CPU}).\n\n| task")
  assert "| rte | acl | 0.0001, 0.9, 0.5 | 1,2,3 | 0.6700 ± 0.0265 | +0.0600 |" in text
  rows = [json.loads(line) for line in
          (tmp_path / "results" / "fair_single_exit.jsonl").read_text().splitlines()]
  assert sorted((r["objective"], r["seed"]) for r in rows) == [
      (o, s) for o in ("acl", "ce") for s in (1, 2, 3)]
  assert (tmp_path / "results" / "fair_multi_exit.md").read_text().startswith("fair-2: commit")


def test_the_multi_exit_answer_once_every_cell_is_in(tmp_path):
  """ACL-CL beats every other objective at 2x on RTE only, and its exit 1 (half its average
  here) is above CE's on RTE only; at 1.5x and elsewhere the objectives tie."""
  metrics = {"rte": "accuracy", "mrpc": "f1", "cola": "mcc"}
  sweep = lambda task, at_2x: {"policies": {"entropy": [
      {"speedup_ratio": 1.6, "metrics": {metrics[task]: 0.6}},
      {"speedup_ratio": 2.0, "metrics": {metrics[task]: at_2x}}]}}
  noise = (0.0, 0.01, 0.02)
  for task in metrics:
    selection(tmp_path / "single", task, scl={}, acl={(0.9, 0.5): 0.9})
    variants = [(o, "per_exit") for o in fair.MULTI_EXIT] + [("acl_cl", "global")] * (task == "rte")
    for objective, gate in variants:
      better = 0.1 * (task == "rte" and objective == "acl_cl" and gate == "per_exit")
      aux, temperature = (0.9, 0.5) if objective in fair.GATED else (0.5, 0.3)
      for seed, e in zip((1, 2, 3), noise):
        write_record(tmp_path / "multi", task, objective, seed, 0.5 + better + e, aux=aux,
                     temperature=temperature, multi_exit=True, gate=gate,
                     early_exit=sweep(task, 0.5 + better + e))
  single, multi = (fair.read_records(tmp_path / d) for d in ("single", "multi"))
  verdict, evidence = fair_report.answer_multi_exit(multi, single)
  assert verdict == (
      "Against the best other objective at equal counted speed-up, ACL-CL is significantly "
      "higher on RTE ≥ 2x, significantly lower on none, and not significantly different on "
      "RTE ≥ 1.5x, MRPC ≥ 1.5x, MRPC ≥ 2x, CoLA ≥ 1.5x and CoLA ≥ 2x. Exit by exit against CE, "
      "it is significantly higher at 1 and significantly lower at 0 of the 3 exits of the 3 "
      "tasks.")
  assert "RTE, exit by exit, ACL-CL − CE: exit 1 +0.0500 (p = " in evidence[0]
  assert evidence[-1].startswith("Gate ablation, RTE ACL-CL exits' average: per-exit "
                                 "0.6100 ± 0.0100, global 0.5100 ± 0.0100; per-exit − global "
                                 "+0.1000")
  # The notebooks' paths to it: the results notebook's paragraphs and the README's summary.
  assert (f"**ACL-CL, the shallow exits and the quality-speed trade-off.** {verdict}\n- "
          + "\n- ".join(evidence)) in fair_report.answers(single, multi)
  assert fair_report.summary(single, multi).endswith(
      f"- **ACL-CL, the shallow exits and the quality-speed trade-off.** {verdict}")


class Script:
  """execute() for fair.Lanes: each call blocks until the test releases its command, and the
  test can wait until a given number of calls have started."""

  def __init__(self, codes=None):
    self.codes = codes or {}
    self.started, self.release = [], collections.defaultdict(threading.Event)
    self.running = collections.Counter()
    self.lock = threading.Condition()

  def __call__(self, command, cores):
    with self.lock:
      self.running[command] += 1
      self.started.append((command, frozenset(cores), dict(self.running)))
      self.lock.notify_all()
    assert self.release[command].wait(10), f"{command} never released"
    with self.lock:
      self.running[command] -= 1
    return self.codes.get(command, 0)

  def wait_started(self, n):
    with self.lock:
      assert self.lock.wait_for(lambda: len(self.started) >= n, 10), self.started


def start_lanes(lanes, script):
  thread = threading.Thread(target=lanes.run, args=(script, [{0}, {1}]))
  thread.start()
  return thread


def test_lanes_take_new_commands_as_the_plan_grows_and_join_rather_than_idle():
  a, b, c = ("a",), ("b",), ("c",)
  plans = iter([{a: 1, b: 1, c: 1}] * 5)  # the plan after a finishes: c appears
  lanes, script = fair.Lanes({a: 1, b: 1}, lambda: next(plans)), Script()
  thread = start_lanes(lanes, script)
  script.wait_started(2)
  assert {s[0] for s in script.started} == {a, b}
  script.release[a].set()
  script.wait_started(3)
  assert script.started[2][0] == c  # the lane a freed takes the new command
  script.release[b].set()
  script.wait_started(4)
  # Nothing new: b's lane joins c (a second worker on its study) while c still runs.
  command, cores, running = script.started[3]
  assert command == c and running[c] == 2 and cores != script.started[2][1]
  script.release[c].set()
  thread.join(10)
  assert not thread.is_alive() and [s[0] for s in script.started[2:]] == [c, c]
  assert lanes.failed == [] and lanes.stopped is None


def test_a_lane_resumes_a_stopped_run_while_the_other_runs_a_command_that_holds_none():
  """The runs a stop left part way go first; their command waits for them, the others do not
  (with one stopped run the second lane must not idle). A failed resume is left to its
  command's run_grid, which is taken once the resume ends."""
  a, b, resume_a = ("a",), ("b",), ("resume a",)
  plans = iter([{a: 2}, {a: 2}, {}, {}])  # after b, after the resume, after a's two workers
  script = Script(codes={resume_a: 1})
  lanes = fair.Lanes({a: 2, b: 1}, lambda: next(plans),
                     resumes=[(a, lambda cores: script(resume_a, cores))])
  thread = start_lanes(lanes, script)
  script.wait_started(2)
  assert [s[0] for s in script.started] == [resume_a, b]
  script.release[b].set()
  with lanes.changed:  # b has ended; its lane must wait for the resume rather than take a
    assert lanes.changed.wait_for(lambda: not lanes.workers, 10)
  time.sleep(0.2)
  assert len(script.started) == 2
  script.release[resume_a].set()
  script.wait_started(4)  # a's worker, then the other lane joins it
  script.release[a].set()
  thread.join(10)
  assert not thread.is_alive()
  assert [s[0] for s in script.started] == [resume_a, b, a, a]  # a's lane, then one joining
  assert not script.started[2][2].get(resume_a)  # a started once its resume had ended
  assert lanes.failed == [] and lanes.stopped is None


def test_a_stopped_run_stops_every_lane_and_a_failed_one_only_its_command():
  a, b, c = ("a",), ("b",), ("c",)
  lanes = fair.Lanes({a: 1, b: 1, c: 1}, lambda: {a: 1, b: 1, c: 1})
  script = Script(codes={a: 1, b: fair.PREEMPTED})
  thread = start_lanes(lanes, script)
  script.wait_started(2)
  script.release[a].set()  # a fails: its lane goes on to c
  script.wait_started(3)
  assert script.started[2][0] == c and lanes.failed == [a]
  script.release[b].set()  # b is stopped by a signal: nothing more is taken
  with lanes.changed:
    assert lanes.changed.wait_for(lambda: lanes.stopped is not None, 10)
  script.release[c].set()
  thread.join(10)
  assert not thread.is_alive() and lanes.stopped == fair.PREEMPTED
  assert len(script.started) == 3  # c was not joined after the stop


def test_a_plan_that_cannot_be_made_stops_the_lanes_and_raises_its_error():
  a, b, c = ("a",), ("b",), ("c",)

  def replan():
    raise ValueError("records/fair_1/rte_ce_s1/eval_results.json: not JSON")

  lanes, script, raised = fair.Lanes({a: 1, b: 1, c: 1}, replan), Script(), []

  def run():
    try:
      lanes.run(script, [{0}, {1}])
    except ValueError as error:
      raised.append(error)

  thread = threading.Thread(target=run)
  thread.start()
  script.wait_started(2)
  script.release[a].set()  # a's lane cannot plan again: it takes nothing more, nor does b's
  with lanes.changed:
    assert lanes.changed.wait_for(lambda: lanes.error is not None, 10)
  script.release[b].set()
  thread.join(10)
  assert not thread.is_alive() and [str(e) for e in raised] == [
      "records/fair_1/rte_ce_s1/eval_results.json: not JSON"]
  assert {s[0] for s in script.started} == {a, b}  # c was never taken


def test_a_command_that_ends_with_runs_left_is_taken_again_while_it_moves_on():
  """A worker can end with points left (another command's worker held them): its command is
  taken again as long as each take leaves fewer runs, so a command stuck on its points ends."""
  a, b = ("a",), ("b",)
  # a: 3 left; after its first take 1 (progress: again), after its second still 1 (no more).
  plans = iter([{a: 1, b: 1}, {a: 1, b: 1}, {a: 1}])
  lanes, script = fair.Lanes({a: 3, b: 1}, lambda: next(plans)), Script()
  script.release[a].set()
  script.release[b].set()
  thread = threading.Thread(target=lanes.run, args=(script, [{0}]))  # one lane: no joining
  thread.start()
  thread.join(10)
  assert not thread.is_alive() and [s[0] for s in script.started] == [a, a, b]
  assert lanes.failed == [] and lanes.stopped is None


def test_a_command_is_planned_while_run_grid_would_still_run_one_of_its_points(tmp_path):
  """fair.runs_left reads the run directories and records as run_grid names them (documented in
  run_grid's docstring: <task>_<objective>_s<seed>[_<field>=<value>...])."""
  records = tmp_path / "records"
  command = fair.grid_command(tmp_path / "fair_1_multi_exit", records, "rte", ["ce", "kd"],
                              [1, 2], {"learning_rate": (1e-4,)}, parallel=1,
                              preset=fair.MULTI_EXIT_PRESET, early_exit=True)
  assert fair.runs_left(command) == 4
  names = [f"rte_{o}_s{s}_learning_rate=0.0001" for o in ("ce", "kd") for s in (1, 2)]
  for name in names[:2]:  # trained and swept: done
    (records / name).mkdir(parents=True)
    (records / name / "eval_results.json").write_text("{}")
    (records / name / "early_exit.json").write_text("{}")
  # Trained, its sweep missing but its checkpoints there: run_grid sweeps it, so it is left.
  trained = tmp_path / "fair_1_multi_exit" / names[2]
  (trained / "checkpoints").mkdir(parents=True)
  (trained / "eval_results.json").write_text("{}")
  assert fair.runs_left(command) == 2
  (trained / "early_exit.json").write_text("{}")
  assert fair.runs_left(command) == 1
  assert fair.to_do([command, command[:-3]]) == {tuple(command): 1, tuple(command[:-3]): 1}


def test_a_lane_runs_its_command_on_its_own_core_with_xla_threads_to_match(tmp_path):
  core = max(os.sched_getaffinity(0))
  check = ("import os, sys; sys.exit(0 if os.sched_getaffinity(0) == {%d} and "
           "'--xla_cpu_multi_thread_eigen=false' in os.environ['XLA_FLAGS'] else 3)" % core)
  assert fair.run_pinned(["-c", check], {core}, tmp_path, set()) == 0
  assert fair.run_pinned(["-c", "import sys; sys.exit(5)"], {core}, tmp_path, set()) == 5
