"""The job around training: how a megadyn job lives under torchrun.

    from megadyn.launch.run import main        # what pretrain_gpt.py runs on every rank

run.py (the one run function and its step hooks), torchrun_env.py (torchrun's environment, read
once), distributed_init.py (the default process group), startup.py (where a start's seconds
go), fork_server.py (restarted workers fork from a pre-imported process), watchdog.py
(heartbeats), snapshots.py and snapshot_keeper.py (in-host-memory snapshots, resuming),
replan.py (a layout for the world a restart came back with), errors.py (one message per
failure), `python -m megadyn.launch` (__main__.py, agent.py: torchrun whose agent keeps the
survivors of a failed worker running) and failures.py (who died, as that agent records it).
This package sits above megadyn/training, which never imports it.

Nothing is imported here: fork_server.py's client runs before torch is imported.
"""
