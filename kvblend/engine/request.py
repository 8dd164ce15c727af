"""What crosses the engine boundary: a request in, token events and honest prefill stats out."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace

from kvblend.blend.segmenter import Segments
from kvblend.policy import PrefillPolicy


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # added to the model's EOS ids
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the top k

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be within [0, 20], got {self.logprobs}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")


@dataclass
class GenerationRequest:
    """One request. Its prefill is one ``PrefillPolicy`` (fields left None take the engine's
    BlendConfig); ``mode=``, ``recompute_ratio=``, ``selection=`` ("lookahead:8" allowed) and
    ``lookahead_layers=`` are accepted as keywords and parsed into it here, once."""

    segments: Segments
    sampling: SamplingParams = field(default_factory=SamplingParams)
    policy: PrefillPolicy = field(default_factory=PrefillPolicy)
    namespace: str = ""  # tenant: part of every store key, so tenants never share KV
    # Target first-token agreement with full prefill: the engine picks mode, ratio and selection
    # (kvblend/engine/fidelity.py). None: BlendConfig.fidelity; exclusive with
    # recompute_ratio/selection.
    fidelity: float | None = None
    mode: InitVar[str | None] = None
    recompute_ratio: InitVar[float | None] = None
    selection: InitVar[str | None] = None
    lookahead_layers: InitVar[int | None] = None

    def __post_init__(self, mode, recompute_ratio, selection, lookahead_layers):
        fields = (mode, recompute_ratio, selection, lookahead_layers)
        if any(f is not None for f in fields):
            given = PrefillPolicy.from_fields(*fields)
            self.policy = replace(
                given,
                mode=given.mode or self.policy.mode,
                ratio=self.policy.ratio if given.ratio is None else given.ratio,
                selection=given.selection or self.policy.selection,
                lookahead_layers=self.policy.lookahead_layers
                if given.lookahead_layers is None
                else given.lookahead_layers,
            )


@dataclass
class PrefillStats:
    """Where every prompt token's KV came from.

    prompt_tokens = reused_tokens + recomputed_tokens + fresh_tokens
    cached_tokens = reused_tokens: rows whose stored KV was used as is. Rows loaded and then
    recomputed by blend's selection are work done in this request, so they are not cached tokens
    (the API's ``prompt_tokens_details.cached_tokens`` and Anthropic's ``cache_read_input_tokens``).
    """

    mode: str
    recompute_ratio: float
    selection: str | None = (
        None  # blend's token selection ("lookahead:8": its depth); None for other modes
    )
    prompt_tokens: int = 0
    reused_tokens: int = 0  # loaded from the store and used as is
    recomputed_tokens: int = 0  # loaded, then selected and recomputed past the check layer
    fresh_tokens: int = 0  # no stored KV: computed in this request
    chunks_hit: int = 0
    chunks_total: int = 0
    ttft_ms: float = 0.0
    load_ms: float = 0.0  # fetching + assembling stored KV
    compute_ms: float = 0.0
    attention_kernel: str = ""  # the engine's attention: "amx", "avx512bf16", "avx2" or "torch"
    attention_kernel_reason: str | None = (
        None  # why not this CPU's best native build; None when it is
    )
    # Set when a fidelity target chose the setting: the target, the agreement the choice expects
    # (calibration + shadow prefills) and where the choice came from
    # ("calibration", "fallback: ...").
    fidelity: dict | None = None

    @property
    def cached_tokens(self) -> int:
        return self.reused_tokens

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "selection": self.selection,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "fresh_tokens": self.fresh_tokens,
            "chunks_hit": self.chunks_hit,
            "chunks_total": self.chunks_total,
            "ttft_ms": round(self.ttft_ms, 3),
            "load_ms": round(self.load_ms, 3),
            "compute_ms": round(self.compute_ms, 3),
            "attention_kernel": self.attention_kernel,
            "attention_kernel_reason": self.attention_kernel_reason,
            **({"fidelity": self.fidelity} if self.fidelity is not None else {}),
        }


@dataclass
class TokenEvent:
    """One generated token. ``text`` is the newly decodable text (may be "" mid-codepoint)."""

    token_id: int
    text: str
    index: int
    # With SamplingParams.logprobs: log-probability of token_id under the model's (untempered)
    # distribution, and the top-k [(token_id, logprob)], most likely first.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: PrefillStats
    first_token_logits: object = None  # torch.Tensor [vocab] float32, kept for quality checks


class ContextLengthError(ValueError):
    """The prompt (plus the completion asked for) does not fit the model's context window: the one
    error for it, raised where a request is built and where the engine prefills."""

    def __init__(self, prompt_tokens: int, max_context_len: int, requested: int | None = None):
        self.prompt_tokens, self.max_context_len, self.requested = (
            prompt_tokens,
            max_context_len,
            requested,
        )
        text = (
            f"this model's maximum context length is {max_context_len} tokens; the prompt has "
            f"{prompt_tokens} tokens"
        )
        if requested:
            text += (
                f" and {requested} more were requested for the completion "
                f"({prompt_tokens + requested} in all)"
            )
        super().__init__(text)
