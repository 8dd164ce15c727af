"""Typed configuration for every kvblend component.

Each component gets a small dataclass validated in ``__post_init__``. Defaults that the environment
can set come from ``kvblend/env.py`` (the registry of every variable); what the machine is and how
the process is tuned lives in ``kvblend/platform.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvblend import env
from kvblend.platform import NATIVE_BF16_CPU_FLAGS, cpu_flags
from kvblend.policy import (
    PREFILL_MODES,
    SELECTION_KINDS,
    SELECTION_PRESETS,
    parse_selection,
    validate_lookahead_layers,
    validate_mode,
    validate_ratio,
    validate_selection,
)

__all__ = [
    "PREFILL_MODES",
    "SELECTION_KINDS",
    "SELECTION_PRESETS",
    "parse_selection",
    "validate_lookahead_layers",
    "validate_mode",
    "validate_ratio",
    "validate_selection",
]

# What a check layer compares (kvblend/blend/selection.py): the fresh vs cached values, keys or both
# (the paper's KV deviation), or "attn": a row's attention output over every key vs over its own
# chunk and the prompt's prefix only (what it saw when cached), measurable from layer 0 on.
DEVIATION_KINDS = ("v", "k", "kv", "attn")
DTYPES = ("auto", "bfloat16", "float32", "float16")
# Prefill attention: "auto" uses the native kernel (kvblend/kernels) for the engine's dtype where it
# applies (head_dim 64 on the CPU: bf16 with AMX or else AVX512-BF16, fp32 with AVX2 + FMA) and
# PyTorch's kernels elsewhere; "amx", "avx512bf16" and "avx2" require that kernel; "torch" never
# uses a native one.
ATTENTION_KERNELS = ("auto", "amx", "avx512bf16", "avx2", "torch")


def validate_device(device: str) -> str:
    """ "cpu", "cuda" or "cuda:N" (whether CUDA is there is checked when the model loads)."""
    if device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def default_cache_dir() -> Path:
    """Root for converted weights and the disk KV tier (``KVBLEND_CACHE_DIR`` overrides)."""
    return (
        env.read("KVBLEND_CACHE_DIR")
        or (env.read("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvblend"
    )


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """ "auto" -> the fastest exact-enough dtype here: bfloat16 on CUDA and on CPUs with native bf16
    (AMX or AVX-512 BF16), float32 on other CPUs. Any other value is returned as is."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_flags() & set(NATIVE_BF16_CPU_FLAGS) else "float32"


def default_model() -> str:
    """``KVBLEND_MODEL``: weights (HF dir or .gguf); "" = the embedded SmolLM2-135M-Instruct."""
    return env.read("KVBLEND_MODEL")


def default_dtype() -> str:
    """``KVBLEND_DTYPE`` (auto / bfloat16 / float32 / float16), default auto."""
    return env.read("KVBLEND_DTYPE")


def default_num_threads() -> int:
    """``KVBLEND_THREADS``: torch threads for an engine; 0 leaves torch's default."""
    return env.read("KVBLEND_THREADS")


def default_attention_kernel() -> str:
    """``KVBLEND_ATTENTION_KERNEL`` (auto / amx / avx512bf16 / avx2 / torch), default auto."""
    return env.read("KVBLEND_ATTENTION_KERNEL")


@dataclass
class ModelConfig:
    # A local HF dir (safetensors), a .gguf file, or "" for the embedded SmolLM2-135M-Instruct.
    model: str = field(default_factory=default_model)
    # "auto": bfloat16 where it pays (CUDA, CPUs with AMX or AVX-512 BF16), else float32; resolved
    # here, so everything downstream sees a concrete dtype.
    dtype: str = field(default_factory=default_dtype)
    device: str = "cpu"
    num_threads: int = field(default_factory=default_num_threads)  # 0: leave torch's default
    cache_dir: Path = field(default_factory=default_cache_dir)
    attention_kernel: str = field(default_factory=default_attention_kernel)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.device = validate_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention_kernel must be one of {ATTENTION_KERNELS}, "
                f"got {self.attention_kernel!r}"
            )
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        self.cache_dir = Path(self.cache_dir)


@dataclass
class BlendConfig:
    """Defaults for the prefill path; a request may override mode and ratio."""

    mode: str = "blend"
    # None: the selection's own default (selection "auto": the family's measured ratio; any other
    # selection: DEFAULT_RATIO, the paper's 0.15).
    recompute_ratio: float | None = None
    # Layers where token deviation is measured. One entry = the paper's single check layer; several
    # with shrinking check_ratios = gradual filtering. Empty: the deviation's first useful layer, 1
    # for the KV kinds (layer-0 KV is context-free), 0 for "attn".
    check_layers: tuple[int, ...] = ()
    check_ratios: tuple[float, ...] = ()  # empty: every check layer uses recompute_ratio
    deviation: str = "v"
    # "deviation": the tokens whose fresh KV deviates most from the cached (CacheBlend). "query"
    # (experimental: lookahead dominates it): the tokens the query rows attend to most at the check
    # layer (query-aware, as in A3, arXiv 2511.17560). "lookahead": the tokens the query attends to
    # most over all layers of a reuse pass run first; they are recomputed from layer 0 (no check
    # layer). Each is a strategy in kvblend/blend/strategies.py. "auto" (the default): the model
    # family's measured best (kvblend/engine/fidelity.py FAMILY_DEFAULTS), deviation for families
    # never measured.
    selection: str = "auto"
    # How many layers (from layer 0) lookahead's reuse pass runs and sums the query's attention
    # over; 0 = every layer. Fewer layers make the pass cheaper and the ranking coarser
    # (CHANGELOG.md: "Token selection, measured"); a request may override it.
    lookahead_layers: int = 0
    # Keep a blend/reuse request's final KV per segment under chained keys, and use such entries: a
    # later request starting with the same segments (same documents, new question) reuses them as
    # is.
    store_blended_prefix: bool = True
    # Target first-token agreement with full prefill (0..1]: the engine picks ratio and selection
    # from the model's calibration (`kvblend calibrate`), or runs full prefill where none meets it
    # (kvblend/engine/fidelity.py). None: recompute_ratio and selection as given.
    fidelity: float | None = None
    # Shadow-check one in this many fidelity-chosen blends with a full prefill when the engine is
    # idle (0: never); the outcomes move the setting a target picks as traffic drifts.
    fidelity_shadow_every: int = 10

    def __post_init__(self):
        self.fidelity = validate_fidelity(self.fidelity)
        if self.fidelity_shadow_every < 0:
            raise ValueError(
                f"fidelity_shadow_every must be >= 0, got {self.fidelity_shadow_every}"
            )
        validate_mode(self.mode)
        if self.recompute_ratio is not None:
            validate_ratio(self.recompute_ratio)
        if self.deviation not in DEVIATION_KINDS:
            raise ValueError(f"deviation must be one of {DEVIATION_KINDS}, got {self.deviation!r}")
        first_layer = 0 if self.deviation == "attn" else 1
        self.check_layers = tuple(int(x) for x in self.check_layers) or (first_layer,)
        self.check_ratios = tuple(float(x) for x in self.check_ratios)
        if min(self.check_layers) < first_layer:
            raise ValueError(
                f"check_layers must be >= 1 with deviation {self.deviation!r} (layer-0 KV is "
                "context-free; deviation 'attn' can check layer 0)"
            )
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError("check_layers must be strictly increasing")
        if self.check_ratios:
            if len(self.check_ratios) != len(self.check_layers):
                raise ValueError("check_ratios needs one ratio per check layer")
            for r in self.check_ratios:
                validate_ratio(r)
        validate_selection(self.selection)
        validate_lookahead_layers(self.lookahead_layers)


def validate_fidelity(target: float | None) -> float | None:
    """A fidelity target: first-token agreement with full prefill in (0, 1], or None."""
    if target is None:
        return None
    if (
        isinstance(target, bool)
        or not isinstance(target, (int, float))
        or not 0.0 < float(target) <= 1.0
    ):
        raise ValueError(
            f"fidelity must be within (0, 1] (target first-token agreement), got {target!r}"
        )
    return float(target)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    # Chunks are prefilled behind this fixed context (its KV dropped) so their first token is not an
    # attention sink. None: the chat template's opening, i.e. the prompt prefix up to the user turn.
    chunk_context: str | None = None
    # Load stored KV layer by layer on a thread while earlier layers compute (False: load all
    # first).
    pipeline_loads: bool = True
    # reuse / blend with a missing chunk: prefill its rows in context now and compute its standalone
    # KV after the first token (True), or compute it alone before the prefill (False: slower first
    # token).
    defer_missing_chunks: bool = True
    # Free KV-cache / workspace memory kept for reuse by later requests (0: allocate afresh every
    # time).
    buffer_pool_bytes: int = 1 << 30
    # The calibration fidelity targets are met from (`kvblend calibrate`); None: the model's
    # default, <cache_dir>/calibration/<weights dir>-<dtype>.json.
    calibration_path: Path | None = None

    def __post_init__(self):
        if self.buffer_pool_bytes < 0:
            raise ValueError(f"buffer_pool_bytes must be >= 0, got {self.buffer_pool_bytes}")


STORE_TIERS = ("memory", "disk", "redis")


def default_memory_bytes() -> int:
    """The memory tier's budget: a third of this machine's RAM, at least 2 GiB. A fixed 2 GiB filled
    within a few eval examples, since every prefill mode keeps chained entries of its own beside the
    chunks."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return max(2 << 30, total // 3)


@dataclass
class StoreConfig:
    """Chunk KV store: which tiers, their byte budgets, and how the remote tier degrades.

    ``tiers`` is also the lookup order; a hit in a later tier is promoted into the earlier ones.
    """

    tiers: tuple[str, ...] = ("memory",)
    memory_bytes: int = field(default_factory=default_memory_bytes)
    disk_dir: Path | None = None  # None: default_cache_dir() / "kv"
    disk_bytes: int = 20 << 30
    disk_fsync: bool = True  # fsync file + dir before the atomic rename is visible (crash safety)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvblend:"
    redis_ttl_s: int = 0  # 0: entries never expire
    redis_socket_timeout_s: float = (
        0.5  # short: a dead server must cost a request milliseconds, not seconds
    )
    redis_backoff_s: float = (
        1.0  # first wait before reconnecting after an error; doubles per failure
    )
    redis_backoff_max_s: float = 30.0
    async_writes: bool = True  # disk / redis writes go through one background writer thread
    writer_max_pending_bytes: int = 1 << 30  # beyond this, background writes are dropped (counted)

    def __post_init__(self):
        self.tiers = tuple(str(t) for t in self.tiers)
        if (
            not self.tiers
            or len(set(self.tiers)) != len(self.tiers)
            or any(t not in STORE_TIERS for t in self.tiers)
        ):
            raise ValueError(f"tiers must be distinct names from {STORE_TIERS}, got {self.tiers}")
        for name in ("memory_bytes", "disk_bytes", "writer_max_pending_bytes", "redis_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (
            self.redis_socket_timeout_s <= 0
            or self.redis_backoff_s < 0
            or self.redis_backoff_max_s < self.redis_backoff_s
        ):
            raise ValueError(
                "redis timeouts must be > 0 and 0 <= redis_backoff_s <= redis_backoff_max_s"
            )
        self.disk_dir = (
            Path(self.disk_dir) if self.disk_dir is not None else default_cache_dir() / "kv"
        )


def filter_kwargs(cls, kwargs: dict) -> dict:
    """Keep only the keys that are fields of dataclass ``cls`` (CLI / YAML passthrough)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names and v is not None}


def load_env_overrides() -> dict:
    """The store's environment variables (the model's are ModelConfig's defaults)."""
    out: dict = {}
    for var, key in (
        ("KVBLEND_STORE_TIERS", "tiers"),
        ("KVBLEND_STORE_DIR", "disk_dir"),
        ("KVBLEND_REDIS_URL", "redis_url"),
    ):
        if env.is_set(var):
            out[key] = env.read(var)
    return out


def default_config_dir() -> Path:
    """Per-user config root (``auth.json`` lives here); ``XDG_CONFIG_HOME`` respected."""
    return (env.read("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvblend"


# Client endpoint settings taken from the environment; they override auth.json (see
# kvblend/client/auth.py).
# KVBLEND_API_KEY was once both the client's key and a server key: the client still reads it
# (deprecated).
CLIENT_ENV_VARS = {
    "KVBLEND_BASE_URL": "base_url",
    "KVBLEND_CLIENT_API_KEY": "api_key",
    "KVBLEND_MODEL_ID": "model_id",
}


def client_env_overrides() -> dict:
    """{auth.json key: value} for each set client variable (KVBLEND_BASE_URL, _CLIENT_API_KEY,
    _MODEL_ID; the deprecated KVBLEND_API_KEY where KVBLEND_CLIENT_API_KEY is unset)."""
    out = {key: env.read(var) for var, key in CLIENT_ENV_VARS.items() if env.is_set(var)}
    if "api_key" not in out and env.is_set("KVBLEND_API_KEY"):
        out["api_key"] = env.read("KVBLEND_API_KEY")
    return out


# --- server (`kvblend serve`) ------------------------------------------------------------------

BACKEND_KINDS = ("local", "upstream")


# A model entry's own keys; every other key sets its EngineConfig (create_model_entry).
MODEL_ENTRY_KEYS = (
    "id",
    "kind",
    "base_url",
    "upstream_model",
    "api_key_env",
    "timeout_s",
    "retries",
)


@dataclass
class ModelEntry:
    """One model id served by `kvblend serve`.

    kind "local": an in-process engine configured by ``engine`` (``engine.model.model``: a weights
    path; "" = embedded model). kind "upstream": requests are forwarded to another OpenAI-compatible
    service (``base_url``, e.g. ``https://api.example.com/v1``; ``upstream_model``, default ``id``;
    the key is read from the environment variable *named* by ``api_key_env``, never written in the
    file). See docs/GATEWAY.md. A config file's entry is flat: ``create_model_entry``.
    """

    id: str = ""  # "" (local only): the engine's own model_id
    kind: str = "local"
    engine: EngineConfig = field(default_factory=EngineConfig)
    base_url: str = ""
    upstream_model: str = ""
    api_key_env: str = ""
    timeout_s: float = (
        60.0  # upstream: read timeout per request (between stream chunks when streaming)
    )
    retries: int = (
        2  # upstream: extra attempts, only for connection failures before any byte was sent
    )

    def __post_init__(self):
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"model kind must be one of {BACKEND_KINDS}, got {self.kind!r}")
        if self.kind == "upstream" and (not self.id or not self.base_url):
            raise ValueError("an upstream model needs both id and base_url")
        if self.kind == "upstream" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"model {self.id!r}: base_url must start with http:// or https://")
        if self.timeout_s <= 0 or self.retries < 0:
            raise ValueError(f"model {self.id!r}: timeout_s must be > 0 and retries >= 0")

    # the model settings read most, under the names a config file gives them
    @property
    def model(self) -> str:
        return self.engine.model.model

    @property
    def dtype(self) -> str:
        return self.engine.model.dtype

    @property
    def num_threads(self) -> int:
        return self.engine.model.num_threads

    def engine_config(self) -> EngineConfig:
        return self.engine

    def settings(self) -> dict:
        """The flat keys ``create_model_entry`` makes this entry from."""
        eng = self.engine
        own = {k: getattr(self, k) for k in MODEL_ENTRY_KEYS}
        rest = {k: getattr(eng, k) for k in _field_names(EngineConfig) - {"model", "blend"}}
        model = dataclasses.asdict(eng.model)
        return {**own, **model, **rest, "blend": dataclasses.asdict(eng.blend)}


def create_model_entry(where: str = "model", **settings) -> ModelEntry:
    """A ModelEntry from a config file's flat keys: its own (``MODEL_ENTRY_KEYS``), then any
    ModelConfig, EngineConfig or BlendConfig field (``create_engine_config``)."""
    own = {k: settings.pop(k) for k in MODEL_ENTRY_KEYS if k in settings}
    return ModelEntry(**own, engine=create_engine_config(where, **settings))


def create_engine_config(where: str = "engine", **settings) -> EngineConfig:
    """An EngineConfig from flat keys: ModelConfig's fields (model, dtype, device, num_threads,
    cache_dir, attention_kernel), EngineConfig's own (chunk_context, pipeline_loads, ...;
    ``calibration``: calibration_path), BlendConfig's (mode, recompute_ratio, fidelity, ...), and
    ``blend``: a mapping of more BlendConfig fields (unknown ones ignored; flat keys win)."""
    blend = filter_kwargs(BlendConfig, dict(settings.pop("blend", None) or {}))
    if "calibration" in settings:
        settings["calibration_path"] = settings.pop("calibration") or None
    model = {k: settings.pop(k) for k in _field_names(ModelConfig) if k in settings}
    flat_blend = {k: settings.pop(k) for k in _field_names(BlendConfig) if k in settings}
    blend.update({k: v for k, v in flat_blend.items() if v is not None})
    unknown = sorted(set(settings) - _field_names(EngineConfig) - {"model", "blend"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}")
    if settings.get("calibration_path") is not None:
        settings["calibration_path"] = Path(settings["calibration_path"])
    return EngineConfig(model=ModelConfig(**model), blend=BlendConfig(**blend), **settings)


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@dataclass
class ApiKey:
    key: str
    name: str = ""  # shown in logs instead of the key
    namespace: str = ""  # chunk-store tenant: requests under this key never see other tenants' KV

    def __post_init__(self):
        if not self.key:
            raise ValueError("an api key must be non-empty")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    models: list[ModelEntry] = field(default_factory=lambda: [ModelEntry()])
    api_keys: list[ApiKey] = field(default_factory=list)  # empty: auth disabled
    store: StoreConfig = field(default_factory=StoreConfig)
    max_queue: int = 64  # per model: waiting requests beyond this get 429 + Retry-After
    max_batch: int = 8  # per model: sequences decoded together in one engine.step
    default_max_tokens: int = (
        512  # when a request sets neither max_tokens nor max_completion_tokens
    )
    retry_after_s: int = 1
    # Reliability limits (docs/RELIABILITY.md): bodies over max_body_bytes get 413 before they are
    # read; more than max_documents chunks in one request get 400; SIGTERM stops admitting (503) and
    # gives live streams drain_timeout_s to finish before they are ended with an error event.
    max_body_bytes: int = 8 << 20
    max_documents: int = 256
    drain_timeout_s: float = 30.0
    precompute_slice: int = 1  # /v1/chunks documents a worker turn: other requests run in between

    def __post_init__(self):
        if self.max_body_bytes < 1 or self.max_documents < 1 or self.precompute_slice < 1:
            raise ValueError("max_body_bytes, max_documents and precompute_slice must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be within [0, 65535], got {self.port}")
        if not self.models:
            raise ValueError("at least one model is required")
        if self.max_queue < 1 or self.max_batch < 1 or self.default_max_tokens < 1:
            raise ValueError("max_queue, max_batch and default_max_tokens must be >= 1")
        ids = [m.id for m in self.models if m.id]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate model ids in {ids}")


def load_server_env() -> dict:
    """Server keys from the environment: KVBLEND_SERVER_API_KEYS="key[:namespace],..." (the
    deprecated KVBLEND_API_KEYS is still read). KVBLEND_API_KEY is the client's and never switches
    auth on."""
    items = [*env.read("KVBLEND_SERVER_API_KEYS"), *env.read("KVBLEND_API_KEYS")]
    keys: list[ApiKey] = []
    for item in items:
        key, _, namespace = item.partition(":")
        if key:
            keys.append(ApiKey(key=key, name=f"env{len(keys)}", namespace=namespace))
    if env.is_set("KVBLEND_API_KEY") and not keys:
        env.warn_once(
            "KVBLEND_API_KEY is a client setting and no longer turns server auth on; export "
            "KVBLEND_SERVER_API_KEYS (or pass --api-key) for that"
        )
    return {"api_keys": keys} if keys else {}


def read_secret_env(name: str) -> str:
    """An upstream model's key, named in config by ``api_key_env`` (env is read only here)."""
    return env.read_secret(name)
