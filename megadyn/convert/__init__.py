"""Checkpoint conversion: Hugging Face GPT-2 / Llama in and out, offline layout change, generation.

    from megadyn.convert import import_hf, export_hf, relayout
    import_hf("gpt2-hf/", "ckpt/", tp=2, pp=2)       # HF directory -> megadyn checkpoint
    export_hf("ckpt/", "gpt2-out/")                   # megadyn checkpoint -> HF directory
    relayout("ckpt/", "ckpt-tp4/", tp=4)              # checks the layout, copies (layout-free)

The tool is tools/convert_checkpoint.py; generation is tools/generate.py. Weights go through the
state description (megadyn/models/sharding.py): a megadyn checkpoint holds every weight whole
under its global name, so no step here depends on the layout it was saved or will be loaded in.
"""

from megadyn.convert.errors import ConversionError
from megadyn.convert.pipelines import export_hf, import_hf, relayout

__all__ = ["ConversionError", "export_hf", "import_hf", "relayout"]
