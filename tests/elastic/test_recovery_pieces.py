"""Recovery takes a snapshot only when every piece of it exists somewhere: a kill during a
snapshot write, a host lost with its snapshot dir (peer copies), every copy of a piece lost
(the disk checkpoint, said in the log), and the completeness rules themselves."""

import json
import os
import re
import shutil
import signal
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recovery_helpers import (  # noqa: E402
    Progress,
    args,
    assert_matches_reference,
    run_torchrun,
    torchrun_cmd,
    workers_of,
)

from megadyn.launch.snapshots import HostMap, Transfer, choose
from megadyn.testing import free_port, run_pretrain, spawn
from megadyn.testing.damage import flip_bytes
from megadyn.training.checkpoint import latest_checkpoint, missing_pieces

ITERS, INTERVAL = 16, 4
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
RESUMED = re.compile(r"recovery: resuming from the in-memory snapshot \S*iter_(\d+)")


@pytest.fixture(scope="module")
def reference():
    return spawn(run_pretrain, world=1, args=(args(ITERS),))[0].history


# --- torchrun end to end -----------------------------------------------------------------------
def test_kill_during_a_snapshot_write_resumes_from_the_previous_snapshot(tmp_path, reference):
    flags = [*args(ITERS), *LAYOUT, "--elastic-snapshot-interval", str(INTERVAL)]
    cmd = torchrun_cmd(
        ["tests/elastic/kill_mid_snapshot.py", *flags, "--elastic-snapshot-dir", str(tmp_path)],
        nproc=4,
        endpoint=f"127.0.0.1:{free_port()}",
    )
    codes, text = run_torchrun([cmd], env={"KILL_RANK": "1", "KILL_ITERATION": "8"})
    assert codes == [0], text[-3000:]
    assert re.search(r"test: rank 1 killed while writing \S*\.iter_0000008\.partial", text), text
    assert [int(x) for x in RESUMED.findall(text)] == [4], text[-3000:]  # 8 was never whole
    assert_matches_reference(text, reference)  # every step 1..16 logged, reference losses


def test_a_lost_host_is_rebuilt_from_the_peer_copies_on_the_other_host(tmp_path, reference):
    flags = [*args(ITERS), *LAYOUT, "--elastic-snapshot-interval", str(INTERVAL)]
    flags += ["--elastic-snapshot-dir", f"{tmp_path}/$MEGADYN_HOST"]  # one dir per host
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = torchrun_cmd(["pretrain_gpt.py", *flags], nproc=2, nnodes=2, endpoint=endpoint)
    cmds = [["env", f"MEGADYN_HOST={host}", *cmd] for host in "ab"]  # env execs: same pid
    killed, progress = [], Progress()

    def lose_host_b(line, procs):
        if not progress.read(line) or killed or not progress.past(10, 8):  # 8 is whole
            return
        # host b goes, and host a's workers fail with it: both agents count one failure (an
        # agent that restarts only because the other one waits does not count it, and the two
        # would then start the next attempt with different TORCHELASTIC_RESTART_COUNTs)
        workers = workers_of(procs[0].pid) + workers_of(procs[1].pid)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        while any(_alive(pid) for pid in workers):
            time.sleep(0.05)
        killed.append(sorted(os.listdir(tmp_path / "b")))  # b held its pieces and a's copies
        shutil.rmtree(tmp_path / "b")  # the host is gone with its shared memory

    codes, text = run_torchrun(cmds, lose_host_b, deadline_s=200)
    assert codes == [0, 0], text[-3000:]
    resumed = [int(x) for x in RESUMED.findall(text)]
    assert len(killed) == 1 and len(resumed) == 1 and resumed[0] >= 8, text[-3000:]
    assert f"iter_{resumed[0]:07d}" in killed[0]
    copied = f"recovery: copied \\d+ pieces of snapshot iter_{resumed[0]:07d} from host a to host b"
    assert re.search(copied, text), text[-3000:]
    assert_matches_reference(text, reference)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie
    except OSError:
        return False


# --- two simulated hosts in spawned processes --------------------------------------------------
def run_as_host(rank, world, argv):
    """`pretrain_gpt.main` on host a (rank 0) or b (rank 1)."""
    os.environ["MEGADYN_HOST"] = "ab"[rank]
    return run_pretrain(rank, world, argv)


def train_part_way(rank, world, argv, iters):
    """Train to `iters` of the run's --train-iters and keep the snapshots (as a job that dies
    there would)."""
    from megadyn.core.groups import ParallelGroups
    from megadyn.launch.run import step_hooks
    from megadyn.training.arguments import parse_args
    from megadyn.training.trainer import Trainer

    os.environ["MEGADYN_HOST"] = "ab"[rank]
    cfg = parse_args(list(argv), world)
    groups = ParallelGroups.build(cfg.layout(world), members=range(world))
    trainer = Trainer(cfg, groups, "cpu", hooks=step_hooks(cfg, None))  # the snapshot schedule
    trainer.train_iters = iters
    trainer.train()
    groups.destroy()


def two_host_flags(root) -> list[str]:
    return [
        *args(ITERS),
        "--elastic-snapshot-interval",
        "2",
        "--elastic-snapshot-dir",
        f"{root}/shm/$MEGADYN_HOST",
    ]


@pytest.fixture(scope="module")
def stopped_at_7(tmp_path_factory):
    """Snapshots 4 and 6 on hosts a and b; disk checkpoints at 3, 6 and 7."""
    root = tmp_path_factory.mktemp("two-hosts")
    flags = two_host_flags(root) + ["--save", str(root / "disk"), "--save-interval", "3"]
    spawn(train_part_way, world=2, args=(flags, 7))
    for host in "ab":
        assert sorted(os.listdir(root / "shm" / host)) == [
            "iter_0000004",
            "iter_0000006",
            "latest_checkpointed_iteration.txt",
        ]
    return root


def copy_of(stopped, tmp_path):
    shutil.copytree(stopped, tmp_path / "run")
    for late in ("iter_0000006", "iter_0000007"):  # the last disk checkpoint is at 3
        shutil.rmtree(tmp_path / "run" / "disk" / late)
    (tmp_path / "run" / "disk" / "latest_checkpointed_iteration.txt").write_text("3")
    return tmp_path / "run"


def test_each_host_holds_the_full_set_after_a_snapshot(stopped_at_7):
    for host in "ab":
        assert missing_pieces(stopped_at_7 / "shm" / host / "iter_0000006") == []


def test_the_peer_copies_replace_a_lost_host_dir(stopped_at_7, tmp_path, capfd, reference):
    run = copy_of(stopped_at_7, tmp_path)
    shutil.rmtree(run / "shm" / "b")
    losses = spawn(run_as_host, world=2, args=(two_host_flags(run),))[1].history
    out = capfd.readouterr().out
    assert re.search(r"copied \d+ pieces of snapshot iter_0000006 from host a to host b", out), out
    assert RESUMED.findall(out) == ["0000006"], out
    assert losses == pytest.approx(reference[6:], rel=1e-5)  # b's ranks loaded from b's dir


def test_a_piece_lost_on_every_host_falls_back_to_the_disk_checkpoint(
    stopped_at_7, tmp_path, capfd, reference
):
    run = copy_of(stopped_at_7, tmp_path)
    for host in "ab":
        for it in ("iter_0000004", "iter_0000006"):
            os.remove(run / "shm" / host / it / "__1_0.distcp")
    flags = two_host_flags(run) + ["--load", str(run / "disk")]
    losses = spawn(run_as_host, world=2, args=(flags,))[1].history
    out = capfd.readouterr().out
    assert (
        f"recovery: no complete in-memory snapshot (in-memory snapshot {run}/shm/b/iter_0000006"
        f": __1_0.distcp is missing on every host); falling back to the disk checkpoint "
        f"{run}/disk/iter_0000003" in out
    ), out
    assert losses == pytest.approx(reference[3:], rel=1e-5)


def test_bytes_changed_in_a_snapshot_are_refused_naming_the_file(stopped_at_7, tmp_path):
    """Host a's copy of a weight changed after the save: the rank that reads it there refuses
    the snapshot, naming the file and the tensor, and the recovery fails on every rank."""
    run = copy_of(stopped_at_7, tmp_path)
    snapshot = run / "shm" / "a" / "iter_0000006"
    shard, key = flip_bytes(str(snapshot), "model.")
    with pytest.raises(RuntimeError) as err:
        spawn(run_as_host, world=2, args=(two_host_flags(run),))
    # each rank names the snapshot it loads (its host's copy of iteration 6) and the file it
    # read, host a's; which rank's error comes first is a race
    said = str(err.value)
    copies = [run / "shm" / host / "iter_0000006" for host in "ab"]
    assert any(f"recovery: in-memory snapshot {c}: " in said for c in copies), said[-2000:]
    assert f"{snapshot / shard} fails its checksum in tensor {key} " in said, said[-2000:]


def test_a_piece_lost_everywhere_without_a_disk_checkpoint_is_an_error(stopped_at_7, tmp_path):
    run = copy_of(stopped_at_7, tmp_path)
    for host in "ab":
        for it in ("iter_0000004", "iter_0000006"):
            os.remove(run / "shm" / host / it / ".metadata")
    with pytest.raises(
        RuntimeError, match=r"iter_0000006: no host holds a readable \.metadata, and"
    ):
        spawn(run_as_host, world=2, args=(two_host_flags(run),))


# --- units ---------------------------------------------------------------------------------
def save_tiny(root, iteration: int) -> str:
    path = os.path.join(root, f"iter_{iteration:07d}")
    state = {"a": torch.arange(1000.0), "b": torch.ones(3, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single process without torch.distributed
        dcp.save(state, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "megadyn.json"), "w") as f:
        json.dump({"iteration": iteration}, f)
    return path


def test_a_checkpoint_is_complete_only_when_every_piece_is(tmp_path):
    older, newer = save_tiny(tmp_path, 1), save_tiny(tmp_path, 2)
    assert missing_pieces(newer) == [] and latest_checkpoint(tmp_path) == newer
    shard = next(n for n in os.listdir(newer) if n.endswith(".distcp"))
    full = os.path.getsize(os.path.join(newer, shard))
    with open(os.path.join(newer, shard), "r+b") as f:
        f.truncate(full - 1)  # one byte short of what .metadata places in it
    assert missing_pieces(newer) == [shard]
    assert latest_checkpoint(tmp_path) == older  # the tracker-less scan skips it too
    os.remove(os.path.join(newer, shard))
    assert missing_pieces(newer) == [shard]
    os.remove(os.path.join(newer, ".metadata"))
    assert missing_pieces(newer) == [".metadata"]
    os.remove(os.path.join(older, "megadyn.json"))
    assert missing_pieces(older) == ["megadyn.json"] and latest_checkpoint(tmp_path) is None


def test_peers_are_on_the_next_host():
    assert [HostMap(("a", "a", "b", "b")).peer(r) for r in range(4)] == [2, 3, 0, 1]
    assert [HostMap(("b", "a", "a", "c")).peer(r) for r in range(4)] == [3, 0, 0, 1]
    assert HostMap(("a", "a")).peer(1) is None  # one host: no copy


def test_recovery_picks_the_newest_snapshot_whose_pieces_all_exist():
    need = {".metadata": 10, "__0_0.distcp": 100, "__1_0.distcp": 100}
    whole = {**need, "megadyn.json": 5}
    hosts = HostMap(("a", "b"))
    entry = {"files": whole, "need": need}
    by_host = {
        "a": {8: {"files": {**whole, "__1_0.distcp": 50}, "need": need}, 4: entry},
        "b": {8: {"files": {"megadyn.json": 5}, "need": None}, 4: {"files": {}, "need": None}},
    }
    found = choose(by_host, hosts)
    assert found.iteration == 4
    assert found.unusable == [(8, "__1_0.distcp is short on every host (50 of 100 bytes at most)")]
    assert found.transfers == [
        Transfer(name, size, 0, 1) for name, size in [*sorted(need.items()), ("megadyn.json", 5)]
    ]
    by_host["b"][8] = {"files": {"__1_0.distcp": 100}, "need": None}  # b kept that piece
    found = choose(by_host, hosts)
    assert found.iteration == 8 and found.unusable == []
    assert [(t.name, t.src, t.dst) for t in found.transfers] == [
        ("__1_0.distcp", 1, 0),
        (".metadata", 0, 1),
        ("__0_0.distcp", 0, 1),
        ("megadyn.json", 0, 1),
    ]
    assert choose({"a": {}, "b": {}}, hosts).any_snapshot is False
