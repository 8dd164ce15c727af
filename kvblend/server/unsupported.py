"""Request features kvblend does not implement yet are refused with a 400 naming the field, as vLLM
does, instead of being accepted and silently ignored (a client would then wait for tool calls or
JSON that never come)."""

from __future__ import annotations

from kvblend.server import errors


def check_chat(body) -> None:
    """400 for tools / function calling and a non-text ``response_format`` in a chat request."""
    if body.tools:
        raise errors.invalid_request("tools are not supported by this server yet.", "tools")
    if body.functions:
        raise errors.invalid_request("functions are not supported by this server yet.", "functions")
    if body.tool_choice not in (None, "none"):
        raise errors.invalid_request(
            "tool_choice is not supported by this server yet.", "tool_choice"
        )
    if body.function_call not in (None, "none"):
        raise errors.invalid_request(
            "function_call is not supported by this server yet.", "function_call"
        )
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise errors.invalid_request(
            f"response_format of type {kind!r} is not supported by this server yet; "
            "only 'text' is.",
            "response_format",
        )
