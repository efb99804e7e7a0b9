"""megadyn/bench/table.py (tools/bench_table.py): the median over rounds, and each round's
ratio from that round's pair."""

import json

from megadyn.bench import table as bench_table


def result(row, framework, round_, tokens, mem=10.0):
    return dict(
        row=row,
        framework=framework,
        round=round_,
        tokens_per_s_per_gpu=tokens,
        mfu=0.5,
        peak_mem_gib=mem,
    )


def test_rounds_give_medians_and_per_round_ratios(tmp_path):
    runs = [
        result("tp2", "megatron-core", 1, 20000.0),
        result("tp2", "megadyn", 1, 30000.0),
        result("tp2", "megatron-core", 2, 10000.0),
        result("tp2", "megadyn", 2, 11000.0),
        result("tp2", "megatron-core", 3, 30000.0),
        result("tp2", "megadyn", 3, 36000.0),
        result("tp2_sp", "megadyn", 1, 25000.0),  # one framework only: no ratio
        result("tp2:graph", "megadyn", 1, 40000.0),  # a variant: compared with tp2's mcore
        result("tp2:graph", "megadyn", 2, 12000.0),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    lines = bench_table.table(bench_table.load(str(path)))
    tp2 = next(line for line in lines if line.startswith("| tp2 |"))
    cells = [c.strip() for c in tp2.strip("|").split("|")]
    assert cells[1:5] == ["20,000", "30,000", "1.500", "1.500 1.100 1.200"], cells
    sp = next(line for line in lines if line.startswith("| tp2_sp |"))
    assert [c.strip() for c in sp.strip("|").split("|")][1:5] == ["-", "25,000", "-", "-"]
    graph = next(line for line in lines if line.startswith("| tp2:graph |"))
    cells = [c.strip() for c in graph.strip("|").split("|")]
    assert cells[1:5] == ["20,000", "26,000", "1.300", "2.000 1.200"], cells


def test_a_single_run_without_rounds_reads_as_round_zero(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [
        {"row": "tp1", "framework": f, "tokens_per_s_per_gpu": t, "mfu": 0.4, "peak_mem_gib": 30}
        for f, t in (("megatron-core", 50000.0), ("megadyn", 55000.0))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = bench_table.table(bench_table.load(str(path)))[2]
    assert "| 1.100 | 1.100 |" in line, line
