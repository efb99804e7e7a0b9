"""A small English corpus that exists on every machine with Python, ready to train on.

With no network there is nothing to download, so the default data is the documentation that
ships with the Python standard library: the docstrings of its `.py` modules (read with `ast`,
nothing is imported or executed) and the help topics of `pydoc_data`, in sorted, deterministic
order, capped at `max_bytes` (about 2.5 MB on CPython 3.11). The text differs slightly between
Python versions, so compare loss curves only on one Python version.

    paths = prepare_default_data("runs/data")
    # {"data_prefix": "runs/data/stdlib_docs_spm8192_text_document",
    #  "tokenizer_model": "runs/data/spm_8192.model",
    #  "tokenizer_type": "GPTSentencePieceTokenizer"}

Each step (corpus jsonl, SentencePiece model, indexed dataset) is skipped when its output exists;
outputs are written atomically and the whole preparation holds a file lock, so ranks that call
it together build once. It takes a few seconds on two cores.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import sysconfig
from collections.abc import Iterator

from megadyn.data.atomic_files import write_bytes_atomic
from megadyn.data.indexed_dataset import IndexedDataset
from megadyn.data.preprocess import document_prefix, preprocess_data
from megadyn.data.sp_train import train_sentencepiece

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages"}
SKIP_DIRS |= {"dist-packages", "__pycache__", "venv"}
TOKENIZER_TYPE = "GPTSentencePieceTokenizer"


def _stdlib_sources() -> Iterator[tuple[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            yield module, path


def _docstrings(node: ast.AST, prefix: str) -> Iterator[str]:
    for child in getattr(node, "body", []):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{child.name}"
            doc = ast.get_docstring(child)
            if doc:
                yield f"{name}\n{doc}"
            yield from _docstrings(child, name)


def stdlib_documents(max_bytes: int = 4 << 20) -> list[str]:
    """Documents of the standard library's documentation, in a fixed order, up to max_bytes."""
    documents, total = [], 0
    for module, path in _stdlib_sources():
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, OSError):
            continue
        head = ast.get_docstring(tree)
        parts = ([f"{module}\n{head}"] if head else []) + list(_docstrings(tree, module))
        if parts:
            documents.append("\n\n".join(parts))
    with contextlib.suppress(ImportError):
        from pydoc_data.topics import topics

        documents += [topics[name] for name in sorted(topics)]
    out = []
    for text in documents:
        total += len(text.encode("utf-8"))
        if total > max_bytes:
            break
        out.append(text)
    return out


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    with open(os.path.join(directory, ".prepare.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_default_data(out_dir: str, vocab_size: int = 8192, workers: int = 1) -> dict[str, str]:
    """Build (or find) the default corpus, its tokenizer and its indexed dataset in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, "stdlib_docs.jsonl")
    model_prefix = os.path.join(out_dir, f"spm_{vocab_size}")
    output_prefix = os.path.join(out_dir, f"stdlib_docs_spm{vocab_size}")
    data_prefix = document_prefix(output_prefix, "text")
    with _locked(out_dir):
        if not os.path.isfile(corpus):
            lines = (json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in stdlib_documents())
            write_bytes_atomic(corpus, "".join(lines).encode("utf-8"))
        if not os.path.isfile(model_prefix + ".model"):
            train_sentencepiece([corpus], model_prefix, vocab_size)
        if not IndexedDataset.exists(data_prefix):
            preprocess_data(
                corpus,
                output_prefix,
                TOKENIZER_TYPE,
                tokenizer_model=model_prefix + ".model",
                append_eod=True,
                workers=workers,
            )
    return dict(
        data_prefix=data_prefix,
        tokenizer_model=model_prefix + ".model",
        tokenizer_type=TOKENIZER_TYPE,
    )
