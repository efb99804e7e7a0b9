"""megadyn/bench/dcp_compare.py and documents.py: the skewed samples and the tables of a run."""

import json

import torch

from megadyn.bench.dcp_compare import parse, sample_ids, summarize
from megadyn.bench.documents import document_lengths


def test_samples_are_skewed_packed_documents_the_same_on_every_call():
    c = parse(["--seq", "32768", "--documents", "1024:1.6"])
    ids = sample_ids(c, 0)
    assert ids.shape == (1, 32768) and torch.equal(ids, sample_ids(c, 0))
    assert (ids[0, 1:] - ids[0, :-1]).ge(0).all() and ids[0, 0] == 0  # numbered along
    lengths = [n for i in range(3) for n in document_lengths(sample_ids(c, i)[0])[:-1]]
    median = sorted(lengths)[len(lengths) // 2]
    assert 300 < median < 3000 and max(lengths) > 4 * median  # long tail


def test_summary_lists_rows_and_dynamic_speedups(tmp_path):
    base = dict(part="attention", seq=32768, block=1024, documents=9, longest=20000)
    base.update(work=[2e6, 2.1e6])
    recs = [
        dict(base, sample=0, row="ring", ms=30.0, imbalance=0.4, kv_received=[1, 1]),
        dict(base, sample=0, row="dynamic", ms=10.0, imbalance=0.01, kv_received=[0.5, 0.25]),
        dict(base, sample=0, row="static_blocks", ms=12.5, imbalance=0.4, kv_received=[1, 0]),
        dict(part="e2e", row="dynamic", tokens_per_s_per_gpu=5000.0, iter_s=6.5, peak_mem_gib=60),
        dict(part="e2e", row="static", oom=True),
    ]
    path = tmp_path / "dcp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    table = summarize(str(path))
    assert "| 0 | 9 | 20000 | dynamic | 10.0 | 2.0 2.1 | 1.0% | 0.50 0.25 |" in table
    assert "| 0 | 3.000 | 1.250 |" in table and "| median | 3.000 | 1.250 |" in table
    assert "| dynamic | 5,000 | 6.5 | 60 |" in table and "| static | oom | - | - |" in table
