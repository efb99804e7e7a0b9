"""Small corpora for tests: texts of counting tokens preprocessed into Megatron's format.

    prefix = write_corpus(tmp_dir, ["1 2 3", "4 5"], vocab_size=60)   # .../c_text_document

The texts are whitespace-separated integers below `vocab_size`, read by the NullTokenizer; each
document ends with EOD. It runs tools/preprocess_data.py's command line, so tests exercise it.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def write_corpus(directory, texts: list[str], vocab_size: int) -> str:
    """Write `texts` as jsonl in `directory`, preprocess them; returns the data prefix."""
    directory = Path(directory)
    with open(directory / "docs.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    argv = ["preprocess_data.py", "--input", str(directory / "docs.jsonl"), "--no-progress"]
    argv += ["--output-prefix", str(directory / "c"), "--tokenizer-type", "NullTokenizer"]
    argv += ["--vocab-size", str(vocab_size), "--append-eod"]
    saved = sys.argv
    try:
        sys.argv = argv
        runpy.run_path(str(TOOLS / "preprocess_data.py"), run_name="__main__")
    finally:
        sys.argv = saved
    return str(directory / "c_text_document")
