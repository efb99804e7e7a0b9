"""Bad input gives a clear error naming the tensor, file or flag, and leaves no output behind."""

import json
import os
import subprocess
import sys

import pytest
import torch
from convert_helpers import REPO, export_args, hf_model, import_args, tool
from safetensors.torch import load_file, save_file

from megadyn.convert import ConversionError


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    hf_model("GPT").save_pretrained(path)
    return path


def edited_copy(src, dst, edit_tensors=None, edit_config=None):
    """A copy of the HF directory `src` with its tensors and/or config.json edited."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    tensors = load_file(src / "model.safetensors")
    save_file(edit_tensors(tensors) if edit_tensors else tensors, dst / "model.safetensors")
    return dst


def convert_fails(argv, match, save_dir):
    with pytest.raises(ConversionError, match=match):
        tool("convert_checkpoint").main(argv)
    assert not os.path.exists(save_dir)
    parent = os.path.dirname(os.path.abspath(save_dir))
    assert not [f for f in os.listdir(parent) if ".partial-" in f], "a partial directory is left"


def test_unknown_architecture(gpt2_dir, tmp_path):
    def bert(config):
        return dict(config, architectures=["BertForMaskedLM"], model_type="bert")

    bad = edited_copy(gpt2_dir, tmp_path / "bert", edit_config=bert)
    out = tmp_path / "out"
    convert_fails(import_args(str(bad), str(out)), r"BertForMaskedLM.*not supported", out)


def test_missing_tensor(gpt2_dir, tmp_path):
    def drop(tensors):
        return {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"}

    bad = edited_copy(gpt2_dir, tmp_path / "missing", edit_tensors=drop)
    out = tmp_path / "out"
    convert_fails(
        import_args(str(bad), str(out)), r"'transformer\.h\.1\.mlp\.c_fc\.bias' is missing", out
    )


def test_misshaped_tensor_names_file_and_shapes(gpt2_dir, tmp_path):
    def shrink(tensors):
        name = "transformer.h.0.attn.c_attn.weight"
        return dict(tensors, **{name: tensors[name][:, :190].contiguous()})

    bad = edited_copy(gpt2_dir, tmp_path / "shape", edit_tensors=shrink)
    out = tmp_path / "out"
    match = r"model\.safetensors: tensor 'transformer\.h\.0\.attn\.c_attn\.weight' has shape \[64, 190\], config\.json needs \[64, 192\]"
    convert_fails(import_args(str(bad), str(out)), match, out)


def test_tensors_beyond_the_config(gpt2_dir, tmp_path):
    bad = edited_copy(gpt2_dir, tmp_path / "one", edit_config=lambda c: dict(c, n_layer=1))
    out = tmp_path / "out"
    convert_fails(import_args(str(bad), str(out)), r"unexpected tensor 'transformer\.h\.1\.", out)


def test_no_weights_and_no_config(tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    convert_fails(
        import_args(str(tmp_path / "empty"), str(out)), r"config\.json: no such file", out
    )
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    convert_fails(import_args(str(tmp_path / "empty"), str(out)), r"no weights", out)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--make-vocab-size-divisible-by", "128", "--target-tensor-parallel-size", "2"],
         r"--make-vocab-size-divisible-by 128: a vocabulary of 100 .* rank 1 of 2 no rows"),
        (["--target-tensor-parallel-size", "3"], r"--target-tensor-parallel-size 3 .*heads"),
        (["--target-pipeline-parallel-size", "3"], r"--num-layers \(2\) must be divisible"),
        (["--model-type", "llama"], r"--model-type llama: .* holds a GPT model"),
    ],
    ids=["vocab-does-not-fit", "heads", "layers", "model-type"],
)  # fmt: skip
def test_layout_and_flag_errors(gpt2_dir, tmp_path, extra, match):
    out = tmp_path / "out"
    convert_fails(import_args(str(gpt2_dir), str(out)) + extra, match, out)


def test_non_empty_save_dir_is_left_alone(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="--save-dir .* not empty"):
        tool("convert_checkpoint").main(import_args(str(gpt2_dir), str(out)))
    assert os.listdir(out) == ["keep.txt"]


def test_failure_while_writing_leaves_nothing(gpt2_dir, tmp_path, monkeypatch):
    from megadyn.convert import pipelines

    def write_then_fail(root, *args, **kw):
        os.makedirs(os.path.join(root, "iter_0000000"))
        raise OSError("disk full")

    monkeypatch.setattr(pipelines, "write_checkpoint", write_then_fail)
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(OSError, match="disk full"):
        tool("convert_checkpoint").main(import_args(str(gpt2_dir), str(out)))
    assert os.listdir(tmp_path) == []  # not even the parents it had to create


@pytest.fixture(scope="module")
def gpt2_ckpt(gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("md") / "ckpt"
    tool("convert_checkpoint").main(import_args(str(gpt2_dir), str(out)))
    return out


def test_megadyn_checkpoint_that_disagrees_with_its_args(gpt2_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(gpt2_ckpt, bad)
    meta_path = bad / "iter_0000000" / "megadyn.json"
    meta = json.loads(meta_path.read_text())
    meta["args"]["model.ffn_hidden_size"] = 128
    meta_path.write_text(json.dumps(meta))
    out = tmp_path / "out"
    match = r"tensor 'model\.decoder\.layers\.0\.mlp\.linear_fc1\.weight' has global shape \[256, 64\], the args need \[128, 64\]"
    convert_fails(export_args(str(bad), str(out)), match, out)
    convert_fails(export_args(str(tmp_path / "nothing"), str(out)), "no megadyn checkpoint", out)


def test_model_without_hf_equivalent(tmp_path):
    from megadyn.convert.megadyn_files import write_checkpoint
    from megadyn.models.config import GPTConfig
    from megadyn.models.sharding import init_global, param_specs
    from megadyn.training.arguments import dump_args
    from megadyn.training.config import MegadynConfig

    cfg = GPTConfig.gpt2(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=50,
                         normalization="RMSNorm")  # fmt: skip
    weights = {n: init_global(s, cfg, 1) for n, s in param_specs(cfg).items()}
    write_checkpoint(
        str(tmp_path / "ckpt"), weights, cfg, {"args": dump_args(MegadynConfig(model=cfg))}
    )
    out = tmp_path / "out"
    convert_fails(
        export_args(str(tmp_path / "ckpt"), str(out)),
        r"normalization = 'RMSNorm' has no GPT2LMHeadModel",
        out,
    )


def test_command_line_error_exit_code(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["T5Model"]}))
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
         *import_args(str(tmp_path / "x"), str(tmp_path / "out"))],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("convert_checkpoint.py: error: ") and "T5Model" in proc.stderr
    assert not os.path.exists(tmp_path / "out")
    assert torch.__version__  # the tool ran in a fresh interpreter


def test_damaged_megadyn_checkpoint_is_one_line_naming_the_file(gpt2_ckpt, tmp_path):
    """The tracker names a checkpoint with a short file: exit 2, one line that names the file
    and the tool's own flag, no traceback, nothing written."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(gpt2_ckpt, bad)
    piece = next((bad / "iter_0000000").glob("*.distcp"))
    piece.write_bytes(piece.read_bytes()[:-7])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
         *export_args(str(bad), str(out))],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_checkpoint.py: error: --load-dir "), (
        lines
    )
    assert f"{piece} is short by 7 bytes" in lines[0], lines
    assert "--load " not in lines[0] and "Traceback" not in proc.stderr
    assert not os.path.exists(out)
