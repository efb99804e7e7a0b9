"""route.py: a rank's segments, parts and exchanges derived from a placement, and the run
copies that move tensors along them."""

from __future__ import annotations

import torch

from megadyn.core.context_parallel.placement import place_blocks
from megadyn.core.context_parallel.route import derive_route, merged, put, take


def test_runs_merge_and_move_like_index_ops():
    assert merged([(0, 2), (2, 3), (7, 1), (8, 2), (4, 1)]) == ((0, 5), (7, 3), (4, 1))
    x = torch.arange(20.0).view(10, 2)
    runs = ((6, 2), (1, 3))
    index = torch.tensor([6, 7, 1, 2, 3])
    assert torch.equal(take(x, 0, runs), x[index])
    dst, src = torch.zeros(10, 2), torch.ones(5, 2)
    put(dst, 0, runs, src)
    put(dst, 0, runs, src, add=True)
    assert torch.equal(dst, torch.zeros(10, 2).index_add_(0, index, 2 * src))


def test_segments_cover_each_query_once_over_their_documents_keys():
    """Documents of 5, 9 and 18 tokens, blocks of 4, cp 2 (blocks placed one by one, both
    parts on both ranks): every local query row is in one segment; a segment's keys end at
    its last query and start at its document's start; the parts split by whether another
    rank holds some of those keys, and the exchange sends exactly the blocks the second part
    reads."""
    seq, block = 32, 4
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 18])
    placement = place_blocks(seq, block, 2, ids)
    starts = {0: 0, 1: 5, 2: 14}
    routes = [derive_route(placement, r, ids, 1, "cpu") for r in range(2)]
    for rank, route in enumerate(routes):
        held = set(placement.blocks[rank])
        positions = placement.token_index(rank).tolist()
        rows = []
        for i, part in enumerate(route.parts):
            if part is None:
                continue
            q_rows = [r for a, n in part.rows for r in range(a, a + n)]
            keys = [k for a, n in part.keys for k in range(a, a + n)]
            cu_q, cu_k = part.plan.cu_q, part.plan.cu_k
            for j in range(len(cu_q) - 1):
                mine = [positions[r] for r in q_rows[cu_q[j] : cu_q[j + 1]]]
                seg_keys = keys[cu_k[j] : cu_k[j + 1]]
                doc = ids[0, mine[0]].item()
                assert {ids[0, p].item() for p in mine} == {doc}
                assert seg_keys == list(range(starts[doc], mine[-1] + 1))
                remote = any(k // block not in held for k in seg_keys)
                assert remote == (i == 1)
            rows += q_rows
        assert sorted(rows) == list(range(len(positions)))
        peer = 1 - rank
        wanted = {
            k // block
            for part in route.parts[1:]
            if part is not None
            for a, n in part.keys
            for k in range(a, a + n)
            if k // block not in held
        }
        got = {p // block for a, n in route.receives.get(peer, ()) for p in range(a, a + n)}
        assert wanted <= got
        slot = placement.blocks[peer]
        sent = {
            slot[r // block] for a, n in routes[peer].sends.get(rank, ()) for r in range(a, a + n)
        }
        assert sent == got
