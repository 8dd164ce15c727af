"""Shared helpers for engine tests: real embedded weights, MuSiQue prompts, tiny random-weight models."""

from __future__ import annotations

import importlib.util
import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from kvblend.bench.data import DEFAULT_MUSIQUE
from kvblend.config import BlendConfig, EngineConfig, ModelConfig
from kvblend.engine.engine import Engine, create_engine

MUSIQUE = DEFAULT_MUSIQUE
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
INSTRUCTION = "Answer the question from the passages. Answer within 5 words.\n\n"


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package), so tests call its functions."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Gates parametrized over this run on the CPU everywhere and on CUDA where a GPU is present (CI has none;
# `pytest tests -k cuda` on a GPU machine runs just those).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@lru_cache(maxsize=None)
def embedded_engine(
    dtype: str = "float32", attention_kernel: str = "auto", device: str = "cpu"
) -> Engine:
    """The embedded model; ``attention_kernel`` "auto" takes the native kernel where this CPU has it,
    "torch" pins PyTorch's kernels (so both prefill attention paths stay gated)."""
    return create_engine(
        EngineConfig(
            model=ModelConfig(
                dtype=dtype, device=device, num_threads=2, attention_kernel=attention_kernel
            )
        )
    )


def musique_docs(example: int = 0, num_docs: int = 4) -> tuple[list[str], str]:
    item = json.loads(MUSIQUE.read_text())[example]
    docs = [f"{c['title']}: {' '.join(c['text'].split())}" for c in item["ctxs"][:num_docs]]
    return docs, f"Question: {item['question']}\nAnswer within 5 words."


def tiny_model_dir(tmp: Path, model_type: str = "llama", rope_scaling: dict | None = None) -> Path:
    """A random-weight model of ``model_type`` with the embedded model's tokenizer (so chat templates
    and segments work); small enough to build in a second."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = embedded_engine("float32").loaded.model_dir
    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling is not None:
        kwargs["rope_parameters"] = rope_scaling
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    out = tmp / f"tiny-{model_type}"
    model.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def tiny_engine(model_dir: Path, **blend) -> Engine:
    return create_engine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"), blend=BlendConfig(**blend)
        )
    )
