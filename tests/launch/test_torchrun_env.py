"""torchrun's environment, read in one place (megadyn/launch/torchrun_env.py)."""

from megadyn.launch import torchrun_env

VARIABLES = (
    "RANK WORLD_SIZE LOCAL_RANK GROUP_RANK TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT "
    "TORCHELASTIC_MAX_RESTARTS MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE "
    "TORCHELASTIC_ERROR_FILE MEGADYN_KEEP_SURVIVORS MEGADYN_COORDINATOR"
).split()


def test_without_torchrun_one_process_of_rank_0(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = torchrun_env.current()
    assert (env.rank, env.world_size, env.local_rank, env.max_restarts) == (0, 1, 0, 0)
    assert env.restart_count is None and env.run_id is None and not env.under_torchrun
    assert env.master_addr is None and env.master_port is None and env.error_file is None
    assert not env.keep_survivors and not env.coordinator


def test_under_torchrun(monkeypatch):
    values = (
        "3",
        "4",
        "1",
        "1",
        "job",
        "2",
        "5",
        "10.0.0.1",
        "29500",
        "True",
        "/tmp/err",
        "1",
        "1",
    )
    for name, value in zip(VARIABLES, values):
        monkeypatch.setenv(name, value)
    env = torchrun_env.current()
    assert (env.rank, env.world_size, env.local_rank, env.group_rank) == (3, 4, 1, "1")
    assert (env.run_id, env.restart_count, env.max_restarts) == ("job", 2, 5)
    assert (env.master_addr, env.master_port, env.use_agent_store) == ("10.0.0.1", 29500, True)
    assert (
        env.error_file == "/tmp/err"
        and env.under_torchrun
        and env.keep_survivors
        and env.coordinator
    )
