"""The fork server (on by default under torchrun with restarts): the workers of a restarted
attempt fork from a pre-imported process per host instead of importing torch again, and train
exactly like an uninterrupted run."""

import os
import signal
import time

import recovery_helpers as helpers

from megadyn.testing import free_port, run_pretrain, spawn


def test_restarted_workers_fork_from_the_server(tmp_path):
    iters, interval = 32, 4
    reference = spawn(run_pretrain, world=1, args=(helpers.args(iters),))[0].history
    run_id = f"fork-{free_port()}"
    cmd = helpers.torchrun_cmd(
        [
            "pretrain_gpt.py",
            *helpers.args(iters),
            "--tensor-model-parallel-size",
            "2",
            "--elastic-snapshot-interval",
            str(interval),
            "--elastic-snapshot-dir",
            str(tmp_path / "shm"),
        ],
        nproc=2,
        endpoint=f"127.0.0.1:{free_port()}",
        run_id=run_id,
    )
    kills, starts, progress = [], [0], helpers.Progress()
    sock = []  # the agent's socket path, once the agent exists

    def on_line(line, agents):
        if not sock:
            sock.append(f"/tmp/megadyn-fork-{run_id.replace('-', '_')}-{agents[0].pid}.sock")
        progress.read(line)
        starts[0] += " megadyn: 2 processes" in line
        # kill a worker once snapshot 8 is complete and the fork server is listening, and a
        # forked one once the restarted job completed snapshot 16
        after, snap = (10, 8) if not kills else (20, 16)
        ready = os.path.exists(sock[0]) and starts[0] == len(kills) + 1
        if len(kills) < 2 and progress.past(after, snap) and ready:
            kills.append(sorted(helpers.workers_of(agents[0].pid))[1])
            os.kill(kills[-1], signal.SIGKILL)

    (rc,), text = helpers.run_torchrun([cmd], on_line)
    assert rc == 0, text[-4000:]
    assert len(kills) == 2, text[-3000:]
    helpers.assert_matches_reference(text, reference)
    restarts = [line for line in text.splitlines() if "recovery: restart" in line]
    assert [r["restart"] for r in helpers.recovery_times(text)] == [1, 2]
    for restart in restarts:  # both restarts forked (the second one's victim was forked too)
        assert "hand-over to the fork server" in restart, restart
    for _ in range(50):  # the server leaves with the torchrun agent
        if not os.path.exists(sock[0]):
            break
        time.sleep(0.1)
    assert not os.path.exists(sock[0])
    print("\n".join(restarts))


def test_without_a_server_a_restarted_worker_starts_as_usual(monkeypatch, capsys):
    from megadyn.launch import fork_server

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"none-{free_port()}")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(fork_server.FORKED, raising=False)
    fork_server.hand_over(["--train-iters", "2"], time.time())  # returns: nothing listens
    assert f"fork server: none at {fork_server.socket_path()}" in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not fork_server.start(enabled=False)  # --no-elastic-fork-server: a marker, no server
    try:
        fork_server.hand_over(["--no-elastic-fork-server"], time.time())  # off: not even a look
        assert capsys.readouterr().out == ""
    finally:
        os.unlink(fork_server.off_marker(fork_server.socket_path()))


def test_a_server_is_started_only_where_torchrun_may_restart(monkeypatch):
    from megadyn.launch import fork_server

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"norestart-{free_port()}")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert not fork_server.start()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")  # one server per host, started by local rank 0
    assert not fork_server.start()
