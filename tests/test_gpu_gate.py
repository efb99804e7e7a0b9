"""scripts/gpu/smoke.py, the GPU gate, without a GPU: its verdicts, table and JSON line on
made-up inputs (scripts/gpu/gate_report.py, gate_live_change.py), and every command line its checks would start
parsed by pretrain_gpt.py's own parser (nothing is run)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
sys.path.insert(0, str(GPU_SCRIPTS))
import gate_checks  # noqa: E402
import gate_live_change as live  # noqa: E402
import gate_report as report  # noqa: E402
import gate_runner  # noqa: E402
from gate_report import CheckResult  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
DP2_TP2 = "tp1xpp1xdp2->tp2xpp1xdp1"


def iteration(i, loss, ms=350.0, tps=40000.0):
    return {"record": "iteration", "iteration": i, "elapsed_ms": ms, "tokens_per_sec": tps,
            "losses": {"lm loss": loss}}  # fmt: skip


def change(i, old, new, total, rebuild=0.1):
    return {"record": "reconfiguration", "event": "layout", "iteration": i, "old": old,
            "new": new, "total_s": total, "rebuild_s": rebuild}  # fmt: skip


def line(device, checks):
    return json.dumps({"device": {"name": device, "count": 2}, "checks": checks})


# --- table and JSON line --------------------------------------------------------------------------
def test_table_has_one_row_per_check_and_counts_passes():
    rows = [
        CheckResult("fp8", True, 0.0041, seconds=31.2),
        CheckResult("c10d_compat", False, "missing", "no megadyn.core.c10d_compat | x", 0.1),
    ]
    table = report.render_table(rows)
    assert "| fp8 | pass | 0.0041 | 31 |  |" in table
    assert "| c10d_compat | FAIL | missing | 0 | no megadyn.core.c10d_compat / x |" in table
    assert table.rstrip().endswith("1 of 2 checks passed")


def test_a_check_not_run_is_neither_pass_nor_failure():
    """On one GPU the checks that need two are listed as not run; the line passes when every
    check that ran passed, and never when none ran."""
    rows = [CheckResult("fp8_1gpu", True, 0.004), report.not_run("live_change", 2, 1)]
    table = report.render_table(rows)
    assert "| live_change | not run | - | - | needs 2 GPUs, the machine has 1 |" in table
    assert table.rstrip().endswith("1 of 1 checks passed; 1 not run on this machine")
    device = {"name": H100, "count": 1}
    record = report.build_record(rows, date="d", commit="c", megadyn_tree="t", device=device)
    assert record["passed"] is True
    assert record["checks"][1] == {
        "name": "live_change",
        "not_run": "needs 2 GPUs, the machine has 1",
    }
    failed = [CheckResult("fp8_1gpu", False, 0.5, "over")] + rows[1:]
    assert not report.build_record(failed, date="d", commit="c", megadyn_tree="t", device=device)[
        "passed"
    ]
    alone = rows[1:]
    assert not report.build_record(alone, date="d", commit="c", megadyn_tree="t", device=device)[
        "passed"
    ]


def test_record_line_has_the_fields_and_parses_as_strict_json():
    rows = [
        CheckResult("fp8", True, 0.004, extra={"bf16_tokens_per_s": 1e5}),
        CheckResult("kill9_recovery", False, "timeout", "over its 240 s", 240.0),
        CheckResult("cuda_graph_tp2", False, math.inf, "diff"),
    ]
    record = report.build_record(
        rows, date="2026-11-28T10:00:00+00:00", commit="a" * 40, megadyn_tree="b" * 40,
        device={"name": H100, "count": 2}, seconds=301,
    )  # fmt: skip
    parsed = json.loads(report.record_line(record))
    assert {"date", "commit", "megadyn_tree", "device", "checks"} <= set(parsed)
    assert parsed["device"] == {"name": H100, "count": 2} and parsed["passed"] is False
    fp8, killed, graph = parsed["checks"]
    assert fp8 == {"name": "fp8", "passed": True, "figure": 0.004, "bf16_tokens_per_s": 1e5}
    assert killed["figure"] == "timeout" and killed["seconds"] == 240.0
    assert graph["figure"] == "inf"  # no NaN / Infinity tokens in the committed file
    assert report.record_line(record).count("\n") == 1


def test_device_from_nvidia_smi():
    assert report.device_of(f"{H100}\n{H100}\n") == {"name": H100, "count": 2}
    assert report.device_of("") == {"name": "unknown", "count": 0}


def test_select_checks_keeps_the_order_and_refuses_unknown_names():
    names = list(gate_checks.CHECKS)
    assert report.select_checks(names) == names
    assert report.select_checks(names, only="fp8,main_job") == ["main_job", "fp8"]
    assert "main_job" not in report.select_checks(names, skip="main_job")
    with pytest.raises(ValueError, match="fp9"):
        report.select_checks(names, only="fp9")
    assert set(gate_checks.TIMED) | set(gate_checks.POOLED) == set(names)
    assert not set(gate_checks.TIMED) & set(gate_checks.POOLED)


# --- the live change: bounds and the regression rule ----------------------------------------------
def test_live_changes_take_the_first_step_after_each_change():
    """The logged iteration after a change holds the change's seconds; what the first step
    costs beyond the new layout's step (the median of the next iterations, up to the next
    change) is what is left."""
    records = [iteration(i, 7.0) for i in range(1, 7)] + [
        change(6, "tp1xpp1xdp2", "tp2xpp1xdp1", 0.5, 0.2)
    ]
    records += [iteration(7, 6.9, ms=1300.0), iteration(8, 6.8, ms=400.0)]
    records += [iteration(9, 6.8, ms=500.0), iteration(10, 6.7, ms=600.0)]
    records += [change(10, "tp2xpp1xdp1", "tp1xpp2xdp1", 0.25), iteration(11, 6.6, ms=900.0)]
    first, second = live.live_changes(records)
    assert first == {"change": DP2_TP2, "iteration": 6, "total_s": 0.5, "rebuild_s": 0.2,
                     "first_iteration_s": 1.3, "step_s": 0.5, "first_step_extra_s": 0.3}  # fmt: skip
    assert second["first_iteration_s"] == 0.9 and second["step_s"] is None
    assert second["first_step_extra_s"] is None  # no step after it: the verdict says so
    (problem,) = live.live_change_problems([second], None, H100)
    assert "no first_step_extra_s" in problem


def previous_entry(total, step):
    return {
        "name": "live_change",
        "changes": [{"change": DP2_TP2, "total_s": total, "first_step_extra_s": step}],
    }


def test_regression_rule_fails_a_change_more_than_25_percent_slower():
    now = [{"change": DP2_TP2, "total_s": 0.62, "first_step_extra_s": 1.0}]  # +24%: passes
    assert live.live_change_problems(now, previous_entry(0.5, 1.0), "A100") == []
    now[0]["total_s"] = 0.64  # +28%
    (problem,) = live.live_change_problems(now, previous_entry(0.5, 1.0), "A100")
    assert "total_s" in problem and "1.25 x previous" in problem
    now[0].update(total_s=0.5, first_step_extra_s=1.3)  # the first step, +30%
    (problem,) = live.live_change_problems(now, previous_entry(0.5, 1.0), "A100")
    assert "first_step_extra_s" in problem
    assert live.live_change_problems(now, None, "A100") == []  # nothing before: no rule


def test_hard_bound_holds_on_h100_and_h200_only():
    now = [{"change": DP2_TP2, "total_s": 0.81, "first_step_extra_s": 0.9}]
    (problem,) = live.live_change_problems(now, None, H100)
    assert "bound 0.8" in problem
    assert live.live_change_problems(now, None, "NVIDIA A100-SXM4-80GB") == []
    now[0].update(total_s=0.5, first_step_extra_s=1.1)
    assert "bound 1.0" in live.live_change_problems(now, None, "NVIDIA H200")[0]
    other = [{"change": "tp2xpp1xdp1->tp1xpp2xdp1", "total_s": 3.0, "first_step_extra_s": 3.0}]
    assert live.live_change_problems(other, None, H100) == []  # no bound for that one


def test_previous_check_is_the_median_of_the_last_lines_of_the_same_device():
    lines = [
        line(H100, [previous_entry(0.9, 2.0)]),  # fourth from the end: not counted
        line(H100, [previous_entry(0.4, 1.0)]),
        line("NVIDIA H200", [previous_entry(0.3, 0.9)]),
        "not json",
        line(H100, [{"name": "fp8", "passed": True, "figure": 0.01}]),  # an --only run
        line(H100, [previous_entry(0.2, 1.2)]),
        line(H100, [previous_entry(0.5, 1.1)]),
        line("NVIDIA H200", [{"name": "fp8"}]),
    ]
    h100 = live.previous_check(lines, H100, "live_change")
    assert h100["lines"] == 3
    assert h100["changes"] == [{"change": DP2_TP2, "total_s": 0.4, "first_step_extra_s": 1.1}]
    h200 = live.previous_check(lines, "NVIDIA H200", "live_change")
    assert h200["lines"] == 1 and h200["changes"][0]["total_s"] == 0.3
    assert live.previous_check(lines, "cpu", "live_change") is None
    # a figure only the newest line holds has no median: the rule waits for three lines of it
    older = [line(H100, [{"name": "live_change", "changes": [{"change": DP2_TP2, "total_s": t}]}])
             for t in (0.4, 0.5)]  # fmt: skip
    bar = live.previous_check(
        older + [line(H100, [previous_entry(0.45, 0.38)])], H100, "live_change"
    )
    assert bar["changes"] == [{"change": DP2_TP2, "total_s": 0.45}]
    now = [{"change": DP2_TP2, "total_s": 0.45, "first_step_extra_s": 0.48}]
    assert live.live_change_problems(now, bar, "A100") == []
    # one fast run among slower ones does not set the bar (the 0.16 s tp 2 -> pp 2 of c041803)
    runs = [line(H100, [previous_entry(t, 1.0)]) for t in (0.218, 0.207, 0.164)]
    bar = live.previous_check(runs, H100, "live_change")
    now = [{"change": DP2_TP2, "total_s": 0.234, "first_step_extra_s": 1.04}]
    assert live.live_change_problems(now, bar, "A100") == []


def test_live_change_verdict_needs_both_changes_and_the_whole_job():
    first = {7: 1200.0, 15: 1400.0}  # each change's seconds, a step, and 0.35 s more
    records = [iteration(i, 7.0 - i / 10, ms=first.get(i, 350.0)) for i in range(1, 25)]
    records += [
        change(6, "tp1xpp1xdp2", "tp2xpp1xdp1", 0.5),
        change(14, "tp2xpp1xdp1", "tp1xpp2xdp1", 0.7),
    ]
    codes = {"ctl_tp2": 0, "ctl_pp2": 0, "job": 0}
    expected = ["tp2xpp1xdp1", "tp1xpp2xdp1"]
    ok = live.live_change_verdict(codes, records, expected, 24, None, H100)
    assert ok.passed and [c["first_step_extra_s"] for c in ok.extra["changes"]] == [0.35, 0.35]
    assert "tp2xpp1xdp1 0.5 s" in ok.figure
    short = live.live_change_verdict(codes, records, expected, 30, None, H100)
    assert not short.passed and "iteration 24 of 30" in short.reason
    refused = live.live_change_verdict({**codes, "ctl_pp2": 2}, records, expected, 24, None, H100)
    assert not refused.passed and "ctl_pp2" in refused.reason
    one = live.live_change_verdict(codes, records[:-1], expected, 24, None, H100)
    assert not one.passed and "expected" in one.reason
    slow = live.live_change_verdict(codes, records, expected, 24, previous_entry(0.3, 0.35), H100)
    assert not slow.passed and "previous" in slow.reason


# --- kill -9, SIGTERM, the main job ----------------------------------------------------------------
RECOVERY_LINE = (
    " elastic: epoch: 1 | event: failure | iteration: 8 | old: tp1xpp1xdp2+2opt | new: tp1xpp1xdp1"
    " | left: 1 | repeated: 0 | from: replicas | detect_s: 0.05 | total_s: 2.1 | completed: 9"
)


def bench(kill_s=2.7, line=RECOVERY_LINE, code=0):
    return {"exit_code": code, "killed_after_iteration": 8, "kill_to_next_step_s": kill_s,
            "job_recovery_line": line}  # fmt: skip


def test_parse_fields_of_an_elastic_line():
    fields = report.parse_fields(RECOVERY_LINE)
    assert fields["repeated"] == 0 and fields["total_s"] == 2.1 and fields["new"] == "tp1xpp1xdp1"
    assert fields["event"] == "failure" and fields["epoch"] == 1


def test_recovery_verdict():
    base = {i: 7.0 - i / 10 for i in range(1, 17)}
    recovered = {i: v + 0.01 for i, v in base.items()}
    ok = report.recovery_verdict(bench(), 0, recovered, base, 16)
    assert ok.passed and ok.extra["repeated"] == 0 and ok.extra["iterations_compared"] == 8
    assert ok.extra["max_loss_diff"] == pytest.approx(0.01)
    slow = report.recovery_verdict(bench(kill_s=3.2), 0, recovered, base, 16)
    assert not slow.passed and "kill to next step 3.2" in slow.reason
    twice = report.recovery_verdict(
        bench(line=RECOVERY_LINE.replace("repeated: 0", "repeated: 2")), 0, recovered, base, 16
    )
    assert not twice.passed and "repeated 2" in twice.reason
    off = {i: v + (0.06 if i > 8 else 0) for i, v in base.items()}
    assert "loss difference" in report.recovery_verdict(bench(), 0, off, base, 16).reason
    cut = {i: v for i, v in recovered.items() if i < 13}
    assert (
        "4 iterations after the kill" in report.recovery_verdict(bench(), 0, cut, base, 16).reason
    )
    assert not report.recovery_verdict(bench(line=None), 0, recovered, base, 16).passed
    assert report.recovery_verdict(None, 0, {}, {}, 16).figure == "no result"


def test_drain_verdict():
    drain = {"record": "reconfiguration", "event": "drain", "iteration": 12,
             "old": "tp1xpp1xdp2", "new": "tp1xpp1xdp1", "total_s": 0.07}  # fmt: skip
    records = [iteration(i, 7.0) for i in range(1, 101)] + [drain]
    log = (
        " elastic: event: drain | epoch: 1 | iteration: 12 | old: tp1xpp1xdp2 | new: tp1xpp1xdp1\n"
    )
    ok = report.drain_verdict(0, log, records, 100)
    assert ok.passed and ok.figure == "tp1xpp1xdp2->tp1xpp1xdp1 0.07 s"
    assert not report.drain_verdict(0, "", records, 100).passed
    assert "iteration 50 of 100" in report.drain_verdict(0, log, records[:50] + [drain], 100).reason
    assert not report.drain_verdict(0, log, records[:-1], 100).passed  # no drain event
    assert "exit 1" in report.drain_verdict(1, log, records, 100).reason


def test_main_job_verdict():
    records = {i: iteration(i, 9.0 - i / 10, tps=1000.0 * i) for i in range(5, 31, 5)}
    ok = report.main_job_verdict(0, records)
    assert ok.passed and ok.figure == "loss 6.000, 20.0k tok/s" and ok.extra["iterations"] == 30
    flat = {i: iteration(i, 7.0) for i in (5, 10)}
    assert "did not fall" in report.main_job_verdict(0, flat).reason
    assert report.main_job_verdict(1, records).figure == "exit 1"


# --- loss comparisons ------------------------------------------------------------------------------
def test_compare_losses():
    ref = {i: 7.0 - i / 10 for i in range(1, 11)}
    near = {i: v + 0.02 for i, v in ref.items()}
    runs = {"a": 0, "b": 0}
    ok = report.compare_losses("x", runs, near, ref, iterations=list(range(1, 11)), tol=0.05)
    assert ok.passed and ok.figure == pytest.approx(0.02) and ok.extra["iterations_compared"] == 10
    exact = report.compare_losses(
        "x", runs, near, ref, iterations=list(range(1, 11)), tol=0.05, exact=True
    )
    assert not exact.passed and exact.extra["tolerance"] == 0.0
    same = report.compare_losses(
        "x", runs, dict(ref), ref, iterations=list(range(1, 11)), tol=0, exact=True
    )
    assert same.passed and same.figure == 0.0
    missing = report.compare_losses(
        "x", runs, {i: ref[i] for i in range(1, 9)}, ref, iterations=list(range(1, 11)), tol=0.05
    )
    assert not missing.passed and "[9, 10]" in missing.reason
    nan = report.compare_losses(
        "x", runs, {**ref, 3: math.nan}, ref, iterations=list(range(1, 11)), tol=0.05
    )
    assert not nan.passed and nan.figure == math.inf
    failed = report.compare_losses("x", {"a": 0, "b": -9}, near, ref, iterations=[1], tol=0.05)
    assert not failed.passed and "b exit -9" in failed.reason
    rel = report.compare_losses(
        "x",
        runs,
        {i: v * 1.02 for i, v in ref.items()},
        ref,
        iterations=list(range(1, 11)),
        tol=0.03,
        relative=True,
    )
    assert rel.passed and rel.figure == pytest.approx(0.02)
    resumed = report.max_loss_diff({6: 1.0, 7: 1.1}, {i: 1.0 for i in range(1, 11)}, after=5)
    assert resumed == (pytest.approx(0.1), 2)


# --- reading the machine --------------------------------------------------------------------------
def test_reference_model_flags_are_the_scripts_array():
    flags = report.reference_model_flags((GPU_SCRIPTS / "reference_model.sh").read_text())
    assert flags[:2] == ["--num-layers", "24"] and "--use-distributed-optimizer" in flags
    assert flags[-2:] == ["--attention-dropout", "0"]
    text = "# comment\nREFERENCE_MODEL=(--a 1 # why\n  --b)\nOTHER=(--c)\n"
    assert report.reference_model_flags(text) == ["--a", "1", "--b"]


def test_environ_value_and_iteration_lines():
    env = b"PATH=/bin\0RANK=1\0LOCAL_RANK=1\0X=a=b\0"
    assert report.environ_value(env, "RANK") == "1" and report.environ_value(env, "X") == "a=b"
    assert report.environ_value(env, "WORLD_SIZE") is None
    log = " [t] iteration        9/     100 | x\n [t] iteration       10/     100 | y\n"
    assert report.last_iteration(log) == 10 and report.last_iteration("") is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tree_hash_of_files_equals_gits(tmp_path):
    src = tmp_path / "pkg"
    (src / "sub" / "__pycache__").mkdir(parents=True)
    (src / "empty_but_cache" / "__pycache__").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "sub" / "b.py").write_text("y = 2\n")
    (src / "sub-c.txt").write_text("sorts before sub/\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "sub" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run(
        [*git, "add", "pkg/a.py", "pkg/sub/b.py", "pkg/sub-c.txt", "pkg/run.sh"], check=True
    )
    subprocess.run([*git, "commit", "-qm", "t"], check=True)
    want = subprocess.run([*git, "rev-parse", "HEAD:pkg"], capture_output=True, text=True).stdout
    assert report.git_tree_hash(src) == want.strip()


# --- every command line a check would start, through pretrain_gpt.py's parser -----------------------
class RecordingCheck(gate_runner.Check):
    """Runs nothing: records each command and answers as if every process exited 0 at once."""

    def start(self, run, cmd, env=None, where=None, metrics=False):
        if metrics:
            cmd = [*cmd, "--metrics-file", str(self.work / f"{run}.metrics.jsonl")]
        popen = type("Exited", (), {"pid": -1, "poll": lambda self: 0, "wait": lambda self: 0})()
        proc = gate_runner.Proc(run, cmd, self.work / f"{run}.log", popen, 0.0, None)
        self.procs.append(proc)
        self.gate.commands.append(cmd)
        return proc

    def wait_for(self, proc, found, what):
        return True


@pytest.mark.parametrize("tiny", [False, True])
def test_every_check_starts_flags_pretrain_gpt_knows(tmp_path, tiny):
    from megadyn.training.arguments import build_parser

    models = gate_checks.Models.make(tiny)
    gate = gate_runner.Gate(
        gate_checks.CHECKS, tmp_path, tmp_path, 60, models, {"name": H100, "count": 2}
    )
    gate.commands = []
    for name, (fn, _) in gate_checks.CHECKS.items():
        fn(RecordingCheck(gate, name, 60))
    parser = build_parser()
    flag_lists = []
    for cmd in gate.commands:
        for script in ("pretrain_gpt.py", "scripts/train_default.sh"):
            if script in cmd:
                flag_lists.append(cmd[cmd.index(script) + 1 :])
        if "tools/bench_recovery.py" in cmd or "scripts/gpu/lost_host.py" in cmd:
            flag_lists.append(cmd[cmd.index("--") + 1 :])
    # main 1, graph 2, live 1, kill 2 (its uninterrupted run shared with lost_host), lost 1,
    # drain 1, cp 4 (cp1 and p2p once), hot 2, fp8 2, save 2
    assert len(flag_lists) == 18
    for flags in flag_lists:
        parser.parse_args(
            [f for f in flags if f != "--default-job"]
        )  # SystemExit on a flag or choice it does not know
    graph = [f for f in flag_lists if "--enable-cuda-graph" in f]
    assert len(graph) == 1 and "2" == graph[0][graph[0].index("--tensor-model-parallel-size") + 1]
    assert any("--cp-placement" in f and "dynamic" in f for f in flag_lists)
    assert sum("--context-parallel-size" in f for f in flag_lists) == 3
    ctl = [c for c in gate.commands if "tools/elastic_ctl.py" in c]
    assert [c[c.index("--tp") :] for c in ctl] == [
        ["--tp", "2", "--pp", "1", "--at-iteration", "6"],
        ["--tp", "1", "--pp", "2", "--at-iteration", "14"],
    ]
