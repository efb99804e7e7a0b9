"""The in-process recovery on replicas of different depth (--heterogeneous-pipelines): a real
`python -m megadyn.launch` job of 6 processes, 3 + 2 stages and one standby process. kill -9 of
rank 4 (the 2-stage replica's last stage): the standby process takes its place in the same
replicas; then kill -9 of that process: no standby is left and the 4 survivors re-plan (under
--elastic-layout auto: a grid or templates; this tiny model's cost model takes a grid). Every
logged loss equals an uninterrupted run's within 1e-5 and every sample is drawn once."""

from test_in_process_recovery import (  # noqa: F401 (reference: the module's fixture)
    check_losses,
    check_samples,
    job,
    recoveries,
    reference,
)


def test_a_failure_keeps_the_templates_then_replans(tmp_path, reference):  # noqa: F811
    flags = ["--heterogeneous-pipelines", "3", "2", "--elastic-initial-members", "5"]
    code, log, out = job(tmp_path, 6, flags, [(4, 3, "SIGKILL"), (5, 7, "SIGKILL")])
    assert code == 0, log[-3000:]
    first, second = recoveries(log)
    assert first[1:4] == ("tp1x[pp3+pp2]", "tp1x[pp3+pp2]", "4") and first[5] == "replicas"
    assert second[1] == "tp1x[pp3+pp2]" and second[3] == "5" and second[5] == "replicas"
    check_losses(log, reference, most_repeated=2)
    check_samples(out)
