"""megadyn/bench/cp_compare.py: the running order of its rows and the table of a run."""

import json

from megadyn.bench.cp_compare import parse, plan, row_args, summarize


def test_rows_alternate_their_order_and_extras_run_last():
    flags = "--seqs 8 16 --rows cp2 tp2 --rounds 2 --extra cp2@64:full --recompute-from 16"
    c = parse(flags.split() + ["--layers", "2"])
    assert plan(c) == [
        (0, "cp2", 8, "none"), (0, "tp2", 8, "none"), (0, "cp2", 16, "full"), (0, "tp2", 16, "full"),
        (1, "tp2", 8, "none"), (1, "cp2", 8, "none"), (1, "tp2", 16, "full"), (1, "cp2", 16, "full"),
        (-1, "cp2", 64, "full"),
    ]  # fmt: skip
    a = row_args("cp2", 8192, c, "full")
    assert (a.cp, a.tp, a.seq, a.mbs, a.gbs, a.layers, a.recompute) == (2, 1, 8192, 1, 4, 2, "full")
    assert not a.no_grad_accumulation_fusion  # the default weight-gradient path, as other rows


def test_summary_medians_and_per_round_ratios(tmp_path):
    path = tmp_path / "runs.jsonl"
    rows = [("cp2", 0, 130.0), ("tp2", 0, 100.0), ("tp2", 1, 110.0), ("cp2", 1, 121.0)]
    rows += [("cp2_a2a", 0, 90.0)]
    recs = [
        dict(row=r, seq=32768, round=n, tokens_per_s_per_gpu=t, mfu=0.4, peak_mem_gib=50.0)
        for r, n, t in rows
    ] + [dict(row="cp2", seq=65536, round=-1, recompute="none", oom=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    table = summarize(str(path))
    assert "| 32768 | cp2 | 126 | 130 121 | 40.0% | 50.0 | none |" in table
    assert "| 32768 | 0 | cp2 | 1.300 | - | - |" in table
    assert "| 32768 | 1 | cp2 | 1.100 | - | - |" in table
    assert "| 32768 | 0 | cp2_a2a | 0.900 | - | - |" in table  # each cp row against tp2
    assert "| 32768 | 1 | cp2_a2a | - | - | - |" in table
    assert "| 65536 | cp2 | oom |" in table
