"""In-memory snapshots across hosts: each rank's pieces copied to a peer on another host, and
recovery that gathers the pieces of one snapshot from wherever they survived.

    hosts = HostMap.gather(group)                         # every rank's host (collective)
    save_checkpoint(..., group=group, leader=hosts.is_leader(rank),
                    after_write=functools.partial(copy_to_peer, hosts=hosts, group=group))
    ...                                                   # after a restart:
    found = plan_recovery(root, hosts, group)             # newest snapshot with every piece
    path = gather_snapshot(found, root, group)            # each host's dir gets the full set
    load_checkpoint(path, ...)

A snapshot is a DCP checkpoint (megadyn/training/checkpoint.py) in each host's own snapshot dir
(`--elastic-snapshot-dir`, with environment variables expanded, so that hosts simulated on one
machine with `MEGADYN_HOST` can use different dirs). DCP names a rank's files
`__<group rank>_<n>.distcp` and group rank 0 also writes `.metadata`; these are the rank's
pieces. After writing them, each rank sends them to its peer, a rank on the next host (hosts in
name order, round robin over that host's ranks), which stores them in its host's dir. The save
counts (the directory is renamed into place) only after the peer copies are in. With two hosts
each host then holds the full set; with one host there is no other host and no copy.

On recovery the lowest rank of each host lists the snapshots of its dir, every rank receives
all lists, and all pick the same newest iteration whose every piece (`.metadata`, the files it
references at their sizes, `megadyn.json`) exists on at least one host. The pieces a host lacks
are sent to it by a host that has them; afterwards every host's dir holds the full set and the
DCP load reads it unchanged. Only renamed (`iter_N`) directories count: a renamed directory
means that every rank's writes and peer copies had finished.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megadyn.core import c10d_compat
from megadyn.launch import torchrun_env
from megadyn.training.checkpoint import METADATA, STATE_FILE, iter_dir, required_pieces

CHUNK_BYTES = 64 << 20  # files travel in pieces of at most this many bytes
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def snapshot_root(template: str) -> str:
    """The snapshot dir of this host: `--elastic-snapshot-dir` with environment variables
    expanded (`/dev/shm/run/$MEGADYN_HOST`); without one, host shared memory named by
    torchrun's run id (/dev/shm/megadyn-<run id>)."""
    if not template:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return f"{shm}/megadyn-{torchrun_env.current().run_id or 'local'}"
    return os.path.expandvars(template)


@dataclass(frozen=True)
class HostMap:
    """The host of every rank of a group (indexed by group rank)."""

    hosts: tuple[str, ...]

    @classmethod
    def gather(cls, group) -> HostMap:
        """Collective over `group`."""
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, torchrun_env.host_identity(), group=group)
        return cls(tuple(out))

    @property
    def names(self) -> list[str]:
        return sorted(set(self.hosts))

    def ranks_on(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == host]

    def leader(self, host: str) -> int:
        """The rank that does the file work of `host`'s snapshot dir (its lowest)."""
        return self.ranks_on(host)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.hosts[rank]) == rank

    def peer(self, rank: int) -> int | None:
        """The rank on the next host that keeps copies of `rank`'s pieces; None on one host."""
        names = self.names
        if len(names) < 2:
            return None
        host = self.hosts[rank]
        nxt = self.ranks_on(names[(names.index(host) + 1) % len(names)])
        return nxt[self.ranks_on(host).index(rank) % len(nxt)]


@dataclass(frozen=True)
class Transfer:
    """One file sent from group rank `src`'s snapshot dir to group rank `dst`'s."""

    name: str
    size: int
    src: int
    dst: int


def own_pieces(directory: str, rank: int) -> dict[str, int]:
    """{file: size} of the pieces group rank `rank` wrote into a DCP checkpoint directory."""
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".distcp")]
    if rank == 0 and os.path.isfile(os.path.join(directory, METADATA)):
        names.append(METADATA)
    return {n: os.path.getsize(os.path.join(directory, n)) for n in sorted(names)}


def copy_to_peer(directory: str, hosts: HostMap, group) -> None:
    """Send this rank's pieces of the snapshot being written in `directory` to its peer and
    store what other ranks send here (collective over `group`; nothing to do on one host)."""
    if len(hosts.names) < 2:
        return
    listing: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(listing, own_pieces(directory, dist.get_rank(group)), group=group)
    transfers = [
        Transfer(name, size, src, hosts.peer(src))
        for src, files in enumerate(listing)
        for name, size in files.items()
    ]
    run_transfers(transfers, directory, group)


def run_transfers(transfers: list[Transfer], directory: str, group) -> None:
    """Do this rank's part of `transfers`, in their order (the same list on every rank, so
    every send meets its receive): read from or write into this rank's `directory`."""
    me = dist.get_rank(group)
    for t in transfers:
        path = os.path.join(directory, t.name)
        if t.src == me:
            _send_file(path, t.size, t.dst, group)
        elif t.dst == me:
            os.makedirs(directory, exist_ok=True)
            _recv_file(path, t.size, t.src, group)


def _send_file(path: str, size: int, dst: int, group) -> None:
    with open(path, "rb") as f:
        for start in range(0, size, CHUNK_BYTES):
            data = bytearray(f.read(min(CHUNK_BYTES, size - start)))
            if len(data) != min(CHUNK_BYTES, size - start):
                raise OSError(f"{path} is shorter than the {size} bytes announced")
            dist.send(torch.frombuffer(data, dtype=torch.uint8), group=group, group_dst=dst)


def _recv_file(path: str, size: int, src: int, group) -> None:
    tmp = f"{path}.recv"
    buffer = torch.empty(min(CHUNK_BYTES, size), dtype=torch.uint8)
    with open(tmp, "wb") as f:
        for start in range(0, size, CHUNK_BYTES):
            piece = buffer[: min(CHUNK_BYTES, size - start)]  # [n] bytes
            dist.recv(piece, group=group, group_src=src)
            f.write(piece.numpy().tobytes())
    os.replace(tmp, path)  # a file is there whole or not at all


def inventory(root: str) -> dict[int, dict]:
    """{iteration: {"files": {name: size}, "need": required_pieces or None}} of the renamed
    snapshot directories under `root`."""
    found = {}
    names = os.listdir(root) if os.path.isdir(root) else []
    for d in names:
        m = _ITER_DIR.match(d)
        path = os.path.join(root, d)
        if not m or not os.path.isdir(path):
            continue
        files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}
        found[int(m.group(1))] = {"files": files, "need": required_pieces(path)}
    return found


@dataclass
class Recovery:
    """What the snapshots on all hosts allow: the iteration to load (None: none is whole), the
    pieces to copy first, and the newer snapshots that lack a piece on every host."""

    iteration: int | None = None
    transfers: list[Transfer] = field(default_factory=list)
    unusable: list[tuple[int, str]] = field(default_factory=list)
    """(iteration, what is wrong with it) of each newer snapshot passed over."""
    hosts: HostMap | None = None
    any_snapshot: bool = False

    def passed_over(self, root: str) -> list[str]:
        """The newer snapshots that could not be used, newest first, and why."""
        return [f"in-memory snapshot {iter_dir(root, it)}: {why}" for it, why in self.unusable]

    def copies(self) -> list[str]:
        """The pieces copied between hosts, by pair of hosts."""
        pairs: dict[tuple[str, str], int] = {}
        for t in self.transfers:
            key = (self.hosts.hosts[t.src], self.hosts.hosts[t.dst])
            pairs[key] = pairs.get(key, 0) + 1
        return [
            f"copied {n} pieces of snapshot iter_{self.iteration:07d} from host {src} to host "
            f"{dst} (peer copies)"
            for (src, dst), n in sorted(pairs.items())
        ]


def choose(by_host: dict[str, dict[int, dict]], hosts: HostMap) -> Recovery:
    """The newest iteration whose every piece some host holds, and the copies that give every
    host the full set (pure: the same answer on every rank)."""
    iterations = sorted({it for inv in by_host.values() for it in inv}, reverse=True)
    found = Recovery(hosts=hosts, any_snapshot=bool(iterations))
    for it in iterations:
        held = {h: inv[it]["files"] for h, inv in sorted(by_host.items()) if it in inv}
        need = _pieces_of(it, by_host)
        if need is None:
            found.unusable.append((it, f"no host holds a readable {METADATA}"))
            continue
        source = {
            n: next((h for h in held if held[h].get(n, -1) >= s), None) for n, s in need.items()
        }
        lost = sorted(n for n, h in source.items() if h is None)
        if lost:
            found.unusable.append((it, _what_is_wrong(lost[0], need[lost[0]], held)))
            continue
        found.iteration = it
        for host in sorted(by_host):
            have = by_host[host].get(it, {"files": {}})["files"]
            for name in sorted(need, key=lambda n: (n == STATE_FILE, n)):  # megadyn.json last
                if have.get(name, -1) < need[name]:
                    src = source[name]
                    found.transfers.append(
                        Transfer(name, held[src][name], hosts.leader(src), hosts.leader(host))
                    )
        return found
    return found


def _what_is_wrong(name: str, size: int, held: dict[str, dict[str, int]]) -> str:
    """Why no host's copy of piece `name` (`size` bytes at least) can be used."""
    largest = max((files[name] for files in held.values() if name in files), default=None)
    if largest is None:
        return f"{name} is missing on every host"
    return f"{name} is short on every host ({largest} of {size} bytes at most)"


def _pieces_of(iteration: int, by_host: dict[str, dict[int, dict]]) -> dict[str, int] | None:
    """{file: least size} of a snapshot, from the first host that could read its `.metadata`."""
    for _, inv in sorted(by_host.items()):
        need = inv.get(iteration, {}).get("need")
        if need:
            return dict(need, **{STATE_FILE: 1})
    return None


def plan_recovery(root: str, hosts: HostMap, group) -> Recovery:
    """Collective over `group`: the lowest rank of each host lists its snapshots, all ranks
    decide the same `Recovery`."""
    me = dist.get_rank(group)
    mine = inventory(root) if hosts.is_leader(me) else None
    lists: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, mine, group=group)
    by_host = {hosts.hosts[r]: inv for r, inv in enumerate(lists) if inv is not None}
    return choose(by_host, hosts)


def gather_snapshot(found: Recovery, root: str, group) -> str:
    """Copy the pieces each host lacks (collective over `group`); returns the snapshot's dir."""
    path = iter_dir(root, found.iteration)
    run_transfers(found.transfers, path, group)
    dist.barrier(group=group)
    return path


class FinishAgreement:
    """When every member finishes a snapshot whose files are all written, agreed through the
    job's store so that no member waits at a step boundary for a slow writer.

    At each step boundary a member whose own write is done says so under
    `megadyn/snapshot/<iteration>/written/<rank>`; once every member has, the first member names
    the next step as the one to finish at. All members finish at that step: its collectives
    order the first member's write before every other member's next boundary, so all of them
    read the same answer there.
    """

    def __init__(self, iteration: int, members: list[int], rank: int, store=None):
        self.store = store if store is not None else c10d_compat.default_store()
        self.prefix = f"megadyn/snapshot/{iteration}/"
        self.members, self.rank = list(members), rank
        self.announced = self.decided = False

    def finish_now(self, written: bool, step: int) -> bool:
        """Call at every step boundary, on every member; True at the agreed step."""
        if written and not self.announced:
            self.store.set(f"{self.prefix}written/{self.rank}", "1")
            self.announced = True
        decision = self.prefix + "finish_at"
        if self.rank == self.members[0] and self.announced and not self.decided:
            if self.store.check([f"{self.prefix}written/{r}" for r in self.members]):
                self.store.set(decision, str(step + 1))
                self.decided = True
        return self.store.check([decision]) and int(self.store.get(decision)) == step
