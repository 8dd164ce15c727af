"""``POST /tokenize`` and ``POST /detokenize`` as vLLM has them, for local models.

``/tokenize`` with ``messages`` returns the token ids kvblend would prefill for that chat request
(its chat template and document segmentation included); with ``prompt``, the tokenizer's ids for
the text. Tokenizing runs in a thread: a 6k-token prompt must not stall the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from kvblend.blend.segmenter import build_segments_from_messages
from kvblend.server import errors
from kvblend.server.auth import Principal
from kvblend.server.model_info import max_model_len
from kvblend.server.schemas import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = (
        None  # default: True for a prompt (vLLM's); messages use the template
    )
    documents: list[str] | None = None  # kvblend's extension, as in chat requests


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def tokenize_router(state) -> APIRouter:
    router = APIRouter()
    auth = Depends(state.auth)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, _: Principal = auth) -> Any:
        backend = state.resolve(body.model)
        engine = _engine(backend)
        if (body.prompt is None) == (body.messages is None):
            raise errors.invalid_request("Send exactly one of prompt and messages.", "prompt")
        ids = await asyncio.to_thread(_ids, engine, body)
        return {
            "count": len(ids),
            "max_model_len": max_model_len(backend),
            "tokens": ids,
            "token_strs": None,
        }

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, _: Principal = auth) -> Any:
        engine = _engine(state.resolve(body.model))
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise errors.invalid_request(
                f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}", "tokens"
            )
        text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens)
        return {"prompt": text}

    return router


def _engine(backend):
    engine = getattr(backend, "engine", None)
    if engine is None:
        raise errors.invalid_request(
            f"model {backend.id!r} is served by an upstream: tokenize there.", "model"
        )
    return engine


def _ids(engine, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(engine.tokenizer.encode(body.prompt, add_special_tokens=special))
    messages = [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": [p.model_dump() for p in m.content]
            if isinstance(m.content, list)
            else m.content or "",
        }
        for m in body.messages
    ]
    try:
        documents = body.documents or None
        return build_segments_from_messages(engine.tokenizer, messages, documents).token_ids
    except ValueError as e:
        raise errors.invalid_request(str(e), "messages") from None
