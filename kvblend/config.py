"""Typed configuration for every kvblend component, and the one place environment variables are read.

Each component gets a small dataclass validated in ``__post_init__``; ``KVBlendConfig`` composes them.
Callers build configs explicitly (tests, CLI flags) or via ``load_env_overrides`` — no module reads
``os.environ`` anywhere else.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

PREFILL_MODES = ("full", "prefix", "reuse", "blend")
# What a check layer compares (kvblend/blend/selection.py): the fresh vs cached values, keys or both (the
# paper's KV deviation), or "attn": a row's attention output over every key vs over its own chunk and the
# prompt's prefix only (what it saw when cached), measurable from layer 0 on.
DEVIATION_KINDS = ("v", "k", "kv", "attn")
# How a check layer picks the chunk tokens to keep recomputing (kvblend/blend/selection.py).
SELECTION_KINDS = ("deviation", "query", "lookahead")
# "auto": the model family's measured best (selection, ratio), kvblend/engine/fidelity.py FAMILY_DEFAULTS.
SELECTION_PRESETS = ("auto",)
DTYPES = ("auto", "bfloat16", "float32", "float16")
# CPU features that make bf16 prefill pay: AMX tiles (the amx attention kernel) or AVX-512 BF16 (Zen 4: the
# avx512bf16 kernel; one 6,254-token prompt, interleaved, took 8.0 s for full prefill in bf16 against 17.8 s
# in fp32, 1.5 s for blend@0.15 against 3.3 s). Without any native bf16 oneDNN emulates it, several times
# slower than fp32 (measured 7.6x on an AVX2-only EPYC).
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# Prefill attention: "auto" uses the native kernel (kvblend/kernels) for the engine's dtype where it applies
# (head_dim 64 on the CPU: bf16 with AMX or else AVX512-BF16, fp32 with AVX2 + FMA) and PyTorch's kernels
# elsewhere; "amx", "avx512bf16" and "avx2" require that kernel; "torch" never uses a native one.
ATTENTION_KERNELS = ("auto", "amx", "avx512bf16", "avx2", "torch")


def validate_device(device: str) -> str:
    """"cpu", "cuda" or "cuda:N" (whether CUDA is there is checked when the model loads)."""
    if device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def default_cache_dir() -> Path:
    """Root for converted weights and the disk KV tier (``KVBLEND_CACHE_DIR`` overrides)."""
    env = os.environ.get("KVBLEND_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvblend"


def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in /proc/cpuinfo ("" where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((l for l in text.splitlines() if l.startswith(name)), "")
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """Feature flags of this CPU from /proc/cpuinfo (empty where it cannot be read)."""
    return set(_cpuinfo_field("flags").split())


def cpu_model_name() -> str:
    """This CPU's model name from /proc/cpuinfo ("" where it cannot be read)."""
    return _cpuinfo_field("model name")


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """"auto" -> the fastest exact-enough dtype here: bfloat16 on CUDA and on CPUs with native bf16
    (AMX or AVX-512 BF16), float32 on other CPUs. Any other value is returned as is."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_flags() & set(NATIVE_BF16_CPU_FLAGS) else "float32"


def default_attention_kernel() -> str:
    """``KVBLEND_ATTENTION_KERNEL`` (auto / amx / avx512bf16 / avx2 / torch), default auto."""
    return os.environ.get("KVBLEND_ATTENTION_KERNEL") or "auto"


@dataclass
class ModelConfig:
    # A local HF dir (safetensors), a .gguf file, or "" for the embedded SmolLM2-135M-Instruct.
    model: str = ""
    # "auto": bfloat16 where it pays (CUDA, CPUs with AMX or AVX-512 BF16), else float32; resolved here,
    # so everything downstream sees a concrete dtype.
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int = 0  # 0: leave torch's default
    cache_dir: Path = field(default_factory=default_cache_dir)
    attention_kernel: str = field(default_factory=default_attention_kernel)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.device = validate_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        self.cache_dir = Path(self.cache_dir)


@dataclass
class BlendConfig:
    """Defaults for the prefill path; a request may override mode and ratio."""

    mode: str = "blend"
    recompute_ratio: float = 0.15
    # Layers where token deviation is measured. One entry = the paper's single check layer;
    # several with shrinking check_ratios = gradual filtering. Empty: the deviation's first useful layer,
    # 1 for the KV kinds (layer-0 KV is context-free), 0 for "attn".
    check_layers: tuple[int, ...] = ()
    check_ratios: tuple[float, ...] = ()  # empty: every check layer uses recompute_ratio
    deviation: str = "v"
    # "deviation": the tokens whose fresh KV deviates most from the cached (CacheBlend). "query": the
    # tokens the query rows attend to most at the check layer (query-aware, as in A3, arXiv 2511.17560).
    # "lookahead": the tokens the query attends to most over all layers of a reuse pass run first; they
    # are recomputed from layer 0 (no check layer).
    selection: str = "deviation"
    # How many layers (from layer 0) lookahead's reuse pass runs and sums the query's attention over;
    # 0 = every layer. Fewer layers make the pass cheaper and the ranking coarser (README: "Token
    # selection, measured"); a request may override it.
    lookahead_layers: int = 0
    # Keep a blend/reuse request's final KV per segment under chained keys, and use such entries: a
    # later request starting with the same segments (same documents, new question) reuses them as is.
    store_blended_prefix: bool = True
    # Target first-token agreement with full prefill (0..1]: the engine picks ratio and selection from
    # the model's calibration (`kvblend calibrate`), or runs full prefill where none meets it
    # (kvblend/engine/fidelity.py). None: recompute_ratio and selection as given.
    fidelity: float | None = None
    # Shadow-check one in this many fidelity-chosen blends with a full prefill when the engine is idle
    # (0: never); the outcomes move the setting a target picks as traffic drifts.
    fidelity_shadow_every: int = 10

    def __post_init__(self):
        self.fidelity = validate_fidelity(self.fidelity)
        if self.fidelity_shadow_every < 0:
            raise ValueError(f"fidelity_shadow_every must be >= 0, got {self.fidelity_shadow_every}")
        validate_mode(self.mode)
        validate_ratio(self.recompute_ratio)
        if self.deviation not in DEVIATION_KINDS:
            raise ValueError(f"deviation must be one of {DEVIATION_KINDS}, got {self.deviation!r}")
        first_layer = 0 if self.deviation == "attn" else 1
        self.check_layers = tuple(int(x) for x in self.check_layers) or (first_layer,)
        self.check_ratios = tuple(float(x) for x in self.check_ratios)
        if min(self.check_layers) < first_layer:
            raise ValueError(f"check_layers must be >= 1 with deviation {self.deviation!r} (layer-0 KV is "
                             "context-free; deviation 'attn' can check layer 0)")
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
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < float(target) <= 1.0:
        raise ValueError(f"fidelity must be within (0, 1] (target first-token agreement), got {target!r}")
    return float(target)


def validate_selection(selection: str) -> str:
    if selection not in SELECTION_KINDS + SELECTION_PRESETS:
        raise ValueError(f"unknown token selection {selection!r}; expected one of "
                         f"{', '.join(SELECTION_KINDS + SELECTION_PRESETS)}")
    return selection


def validate_lookahead_layers(num_layers: int) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"lookahead_layers must be an integer >= 0 (0 = every layer), got {num_layers!r}")
    return num_layers


def parse_selection(text: str) -> tuple[str, int | None]:
    """A selection as benches name it: "deviation", "query", "lookahead", or "lookahead:N" (the reuse pass
    runs the first N layers) -> (kind, N or None)."""
    kind, sep, depth = text.partition(":")
    validate_selection(kind)
    if not sep:
        return kind, None
    if kind != "lookahead":
        raise ValueError(f"only lookahead takes a layer count ('lookahead:8'), got {text!r}")
    if not depth.isdigit():
        raise ValueError(f"lookahead's layer count must be a whole number ('lookahead:8'), got {text!r}")
    return kind, validate_lookahead_layers(int(depth))


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
    # Load stored KV layer by layer on a thread while earlier layers compute (False: load all first).
    pipeline_loads: bool = True
    # reuse / blend with a missing chunk: prefill its rows in context now and compute its standalone KV
    # after the first token (True), or compute it alone before the prefill (False: slower first token).
    defer_missing_chunks: bool = True
    # Free KV-cache / workspace memory kept for reuse by later requests (0: allocate afresh every time).
    buffer_pool_bytes: int = 1 << 30
    # The calibration fidelity targets are met from (`kvblend calibrate`); None: the model's default,
    # <cache_dir>/calibration/<weights dir>-<dtype>.json.
    calibration_path: Path | None = None

    def __post_init__(self):
        if self.buffer_pool_bytes < 0:
            raise ValueError(f"buffer_pool_bytes must be >= 0, got {self.buffer_pool_bytes}")


STORE_TIERS = ("memory", "disk", "redis")


@dataclass
class StoreConfig:
    """Chunk KV store: which tiers, their byte budgets, and how the remote tier degrades.

    ``tiers`` is also the lookup order; a hit in a later tier is promoted into the earlier ones.
    """

    tiers: tuple[str, ...] = ("memory",)
    memory_bytes: int = 2 << 30
    disk_dir: Path | None = None  # None: default_cache_dir() / "kv"
    disk_bytes: int = 20 << 30
    disk_fsync: bool = True  # fsync file + dir before the atomic rename is visible (crash safety)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "kvblend:"
    redis_ttl_s: int = 0  # 0: entries never expire
    redis_socket_timeout_s: float = 0.5  # short: a dead server must cost a request milliseconds, not seconds
    redis_backoff_s: float = 1.0  # first wait before reconnecting after an error; doubles per failure
    redis_backoff_max_s: float = 30.0
    async_writes: bool = True  # disk / redis writes go through one background writer thread
    writer_max_pending_bytes: int = 1 << 30  # beyond this, background writes are dropped (counted)

    def __post_init__(self):
        self.tiers = tuple(str(t) for t in self.tiers)
        if not self.tiers or len(set(self.tiers)) != len(self.tiers) or any(t not in STORE_TIERS for t in self.tiers):
            raise ValueError(f"tiers must be distinct names from {STORE_TIERS}, got {self.tiers}")
        for name in ("memory_bytes", "disk_bytes", "writer_max_pending_bytes", "redis_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.redis_socket_timeout_s <= 0 or self.redis_backoff_s < 0 or self.redis_backoff_max_s < self.redis_backoff_s:
            raise ValueError("redis timeouts must be > 0 and 0 <= redis_backoff_s <= redis_backoff_max_s")
        self.disk_dir = Path(self.disk_dir) if self.disk_dir is not None else default_cache_dir() / "kv"


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
    if env.get("KVBLEND_STORE_TIERS"):
        out["tiers"] = tuple(t.strip() for t in env["KVBLEND_STORE_TIERS"].split(",") if t.strip())
    if env.get("KVBLEND_STORE_DIR"):
        out["disk_dir"] = env["KVBLEND_STORE_DIR"]
    if env.get("KVBLEND_REDIS_URL"):
        out["redis_url"] = env["KVBLEND_REDIS_URL"]
    return out


# PyTorch's OpenMP threads spin this many rounds after an op before they sleep (GNU OpenMP). On 2 vCPUs,
# sleeping at once (OMP_WAIT_POLICY=PASSIVE) made blend@0.15 5-9% and reuse ~11% slower. The default endless
# spin starved the native kernels' threads: blend@0.15 took 792 ms against 638 with PASSIVE (README,
# "Configuration").
OPENMP_SPIN_COUNT = "10000"


def apply_openmp_defaults() -> bool:
    """Set GOMP_SPINCOUNT before torch loads OpenMP, unless the user chose a wait policy or spin count.
    Returns whether it was set. Too late (no effect) once torch is imported."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return True


# glibc hands freed blocks above its (adaptive) thresholds back to the OS, and a prefill frees and allocates
# tens of MB a layer, so every request faults its working memory in again: a full prefill of a 6,254-token
# prompt (SmolLM2, bf16) took ~156,000 minor page faults, blend@0.15 ~10,700. Taking blocks under
# MALLOC_MMAP_BYTES from the heap and keeping up to MALLOC_TRIM_BYTES of it freed: 706 and 2 faults, full
# 2,045 -> 1,901 ms, blend@0.15 463 -> 445 (README, "Configuration"). The freed memory stays with the process.
MALLOC_MMAP_BYTES = 256 << 20
MALLOC_TRIM_BYTES = 1 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def apply_malloc_defaults() -> bool:
    """Set glibc's mmap and trim thresholds (``mallopt``) for this process, unless the user set glibc's own
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_. Returns whether it was set (False off glibc)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES))


def default_config_dir() -> Path:
    """Per-user config root (``auth.json`` lives here); ``XDG_CONFIG_HOME`` respected."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvblend"


# Client endpoint settings taken from the environment; they override auth.json (see kvblend/client/auth.py).
CLIENT_ENV_VARS = {"KVBLEND_BASE_URL": "base_url", "KVBLEND_API_KEY": "api_key", "KVBLEND_MODEL_ID": "model_id"}


def client_env_overrides() -> dict:
    """{auth.json key: value} for each set client variable (KVBLEND_BASE_URL, _API_KEY, _MODEL_ID)."""
    return {key: os.environ[var] for var, key in CLIENT_ENV_VARS.items() if os.environ.get(var)}


# --- server (`kvblend serve`) ------------------------------------------------------------------

BACKEND_KINDS = ("local", "upstream")


@dataclass
class ModelEntry:
    """One model id served by `kvblend serve`.

    kind "local": an in-process engine over ``model`` (weights path; "" = embedded model).
    kind "upstream": requests are forwarded to another OpenAI-compatible service (``base_url``, e.g.
    ``https://api.example.com/v1``; ``upstream_model``, default ``id``; the key is read from the
    environment variable *named* by ``api_key_env``, never written in the file). See docs/GATEWAY.md.
    """

    id: str = ""  # "" (local only): the engine's own model_id
    kind: str = "local"
    model: str = ""
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int = 0
    mode: str = "blend"
    recompute_ratio: float = 0.15
    fidelity: float | None = None  # target first-token agreement: overrides recompute_ratio (BlendConfig)
    blend: dict = field(default_factory=dict)  # extra BlendConfig fields (check_layers, deviation, ...)
    chunk_context: str | None = None
    calibration: str = ""  # calibration JSON for fidelity targets ("": the model's default path)
    base_url: str = ""
    upstream_model: str = ""
    api_key_env: str = ""
    timeout_s: float = 60.0  # upstream: read timeout per request (between stream chunks when streaming)
    retries: int = 2  # upstream: extra attempts, only for connection failures before any byte was sent

    def __post_init__(self):
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"model kind must be one of {BACKEND_KINDS}, got {self.kind!r}")
        if self.kind == "upstream" and (not self.id or not self.base_url):
            raise ValueError("an upstream model needs both id and base_url")
        if self.kind == "upstream" and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"model {self.id!r}: base_url must start with http:// or https://")
        if self.timeout_s <= 0 or self.retries < 0:
            raise ValueError(f"model {self.id!r}: timeout_s must be > 0 and retries >= 0")
        validate_mode(self.mode)
        self.recompute_ratio = validate_ratio(self.recompute_ratio)
        self.fidelity = validate_fidelity(self.fidelity)

    def engine_config(self) -> EngineConfig:
        fidelity = {"fidelity": self.fidelity} if self.fidelity is not None else {}
        blend = BlendConfig(**{**filter_kwargs(BlendConfig, self.blend), "mode": self.mode,
                               "recompute_ratio": self.recompute_ratio, **fidelity})
        model = ModelConfig(model=self.model, dtype=self.dtype, device=self.device, num_threads=self.num_threads)
        return EngineConfig(model=model, blend=blend, chunk_context=self.chunk_context,
                            calibration_path=Path(self.calibration) if self.calibration else None)


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
    default_max_tokens: int = 512  # when a request sets neither max_tokens nor max_completion_tokens
    retry_after_s: int = 1

    def __post_init__(self):
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
    """Server settings from the environment: KVBLEND_API_KEYS="key[:namespace],..." and KVBLEND_API_KEY."""
    env = os.environ
    keys: list[ApiKey] = []
    for item in (env.get("KVBLEND_API_KEYS") or "").split(","):
        key, _, namespace = item.strip().partition(":")
        if key:
            keys.append(ApiKey(key=key, name=f"env{len(keys)}", namespace=namespace))
    if env.get("KVBLEND_API_KEY"):
        keys.append(ApiKey(key=env["KVBLEND_API_KEY"], name="env"))
    return {"api_keys": keys} if keys else {}


def read_secret_env(name: str) -> str:
    """An upstream model's key, named in config by ``api_key_env`` (env is read only here)."""
    return os.environ.get(name, "") if name else ""
