"""Typed configuration for every kvblend component, and the one place environment variables are read.

Each component gets a small dataclass validated in ``__post_init__``; ``KVBlendConfig`` composes them.
Callers build configs explicitly (tests, CLI flags) or via ``load_env_overrides`` — no module reads
``os.environ`` anywhere else.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

PREFILL_MODES = ("full", "prefix", "reuse", "blend")
DEVIATION_KINDS = ("v", "k", "kv")
DTYPES = ("bfloat16", "float32", "float16")


def default_cache_dir() -> Path:
    """Root for converted weights and the disk KV tier (``KVBLEND_CACHE_DIR`` overrides)."""
    env = os.environ.get("KVBLEND_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvblend"


@dataclass
class ModelConfig:
    # A local HF dir (safetensors), a .gguf file, or "" for the embedded SmolLM2-135M-Instruct.
    model: str = ""
    dtype: str = "bfloat16"
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        self.cache_dir = Path(self.cache_dir)


@dataclass
class BlendConfig:
    """Defaults for the prefill path; a request may override mode and ratio."""

    mode: str = "blend"
    recompute_ratio: float = 0.15
    # Layers where token deviation is measured. One entry = the paper's single check layer;
    # several with shrinking check_ratios = gradual filtering.
    check_layers: tuple[int, ...] = (1,)
    check_ratios: tuple[float, ...] = ()  # empty: every check layer uses recompute_ratio
    deviation: str = "v"

    def __post_init__(self):
        validate_mode(self.mode)
        validate_ratio(self.recompute_ratio)
        self.check_layers = tuple(int(x) for x in self.check_layers)
        self.check_ratios = tuple(float(x) for x in self.check_ratios)
        if not self.check_layers or min(self.check_layers) < 1:
            raise ValueError("check_layers must be non-empty and >= 1 (layer-0 KV is context-free)")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError("check_layers must be strictly increasing")
        if self.check_ratios:
            if len(self.check_ratios) != len(self.check_layers):
                raise ValueError("check_ratios needs one ratio per check layer")
            for r in self.check_ratios:
                validate_ratio(r)
        if self.deviation not in DEVIATION_KINDS:
            raise ValueError(f"deviation must be one of {DEVIATION_KINDS}, got {self.deviation!r}")


def validate_mode(mode: str) -> str:
    if mode not in PREFILL_MODES:
        raise ValueError(f"unknown prefill mode {mode!r}; expected one of {', '.join(PREFILL_MODES)}")
    return mode


def validate_ratio(ratio: float) -> float:
    if not (0.0 <= float(ratio) <= 1.0):
        raise ValueError(f"recompute_ratio must be within [0, 1], got {ratio}")
    return float(ratio)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    # Chunks are prefilled behind this fixed context (its KV dropped) so their first token is not
    # an attention sink. None: the chat template's opening, i.e. the prompt prefix up to the user turn.
    chunk_context: str | None = None


def filter_kwargs(cls, kwargs: dict) -> dict:
    """Keep only the keys that are fields of dataclass ``cls`` (CLI / YAML passthrough)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names and v is not None}


def load_env_overrides() -> dict:
    """Every environment variable kvblend honours, read in one place."""
    env = os.environ
    out: dict = {}
    if env.get("KVBLEND_MODEL"):
        out["model"] = env["KVBLEND_MODEL"]
    if env.get("KVBLEND_DTYPE"):
        out["dtype"] = env["KVBLEND_DTYPE"]
    if env.get("KVBLEND_THREADS"):
        out["num_threads"] = int(env["KVBLEND_THREADS"])
    return out
