"""A checkpoint trained by pretrain_gpt.py (tp 2, with optimizer state), shared by the tests."""

import pytest
from convert_helpers import TRAIN, sentencepiece_model, train, with_tokenizer


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(save root holding iter_0000003 and iter_0000006, the losses of the 6 steps); the job is
    TRAIN + --train-iters 6 at tp 2."""
    save = str(tmp_path_factory.mktemp("trained") / "ckpt")
    flags = ["--tensor-model-parallel-size", "2", "--train-iters", "6"]
    losses = train(2, TRAIN + flags + ["--save", save, "--save-interval", "3"])
    return save, losses


@pytest.fixture(scope="session")
def sp_trained(tmp_path_factory):
    """(save root, SentencePiece model): 3 iterations on 1 process of TRAIN with a tiny
    GPTSentencePieceTokenizer instead of the NullTokenizer."""
    root = tmp_path_factory.mktemp("sp_trained")
    model = sentencepiece_model(str(root))
    tokenizer = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    flags = ["--train-iters", "3", "--save", str(root / "ckpt"), "--save-interval", "3"]
    train(1, with_tokenizer(TRAIN, *tokenizer) + flags)
    return str(root / "ckpt"), model
