"""Request / response bodies of the OpenAI-compatible API, plus kvblend's extension fields.

Unknown request fields are ignored (``extra="ignore"``), as OpenAI-compatible servers do for
parameters they do not implement (presence_penalty, logit_bias, user, ...). Extensions, sent by the
OpenAI SDK through ``extra_body``: ``documents``, ``mode``, ``recompute_ratio``, ``selection``,
``fidelity`` (deviation, query, lookahead, or lookahead:N: the reuse pass's first N layers).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from kvblend.policy import parse_selection

Mode = Literal["full", "prefix", "reuse", "blend"]


def _valid_selection(text: str) -> str:
    parse_selection(text)  # a ValueError names what is accepted
    return text


# blend's token selection (kvblend.policy.Selection), or "lookahead:N"
SELECTION_PATTERN = r"^(deviation|query|auto|lookahead(:[0-9]{1,4})?)$"
Selection = Annotated[
    str,
    AfterValidator(_valid_selection),
    WithJsonSchema({"type": "string", "pattern": SELECTION_PATTERN}),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    text: str


DocumentIn = Union[str, Document]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(_Request):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    n: int | None = Field(default=None, ge=1, le=1)  # one choice per request: send n requests
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored, as documented for servers that do not implement them.
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    # kvblend extensions
    documents: list[DocumentIn] | None = Field(default=None, max_length=4096)
    mode: Mode | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1)
    selection: Selection | None = None
    fidelity: float | None = Field(
        default=None, gt=0, le=1
    )  # target first-token agreement with full


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Not supported yet: using one is a 400 naming the field (kvblend/server/unsupported.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] = Field(min_length=0)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=1)


class ChunksRequest(_Request):
    """POST /v1/chunks: precompute documents' KV so later requests that contain
    them hit the store."""

    model: str | None = None  # optional when one model is served
    documents: list[DocumentIn] = Field(min_length=1, max_length=4096)


# --- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    kvblend: dict[str, Any] | None = (
        None  # PrefillStats.as_dict(): where each prompt token's KV came from
    )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs`` when the request asked for them (server/logprobs.py)."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions ``logprobs`` object: one entry a generated token in each list."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvblend"
    max_model_len: int | None = None  # context window in tokens (vLLM's field); None: upstream


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChunkInfo(BaseModel):
    id: str
    num_tokens: int
    cached: bool  # already in the store before this call
    key: str | None = None


class ChunksResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ChunkInfo]
    usage: dict[str, int]


class Health(BaseModel):
    status: str  # "ok", or "degraded" when an upstream model's service is unreachable
    models: list[str]
    upstreams: dict[str, dict[str, Any]] | None = (
        None  # upstream id -> reachable, status, latency_ms / error
    )
    # local model id -> {"kernel": "amx" | "avx512bf16" | "avx2" | "torch", "reason": why not the
    # CPU's best native build, or None}
    attention: dict[str, dict[str, Any]] | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
