"""Next-token choice from float32 logits: greedy, or temperature + top-p with a per-request
generator."""

from __future__ import annotations

import torch

from kvblend.engine.request import SamplingParams


def create_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(
        params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    )
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] float32 -> token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # a temperature so small the logits overflow
        return int(torch.argmax(logits).item())  # its limit: greedy
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head whose mass reaches top_p.
        cut = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        cut[0] = False  # the first token always stays, even where top_p rounds to 0 in float32
        sorted_probs[cut] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(
    logits: torch.Tensor, token_id: int, top_k: int
) -> tuple[float, list[tuple[int, float]]]:
    """logits [vocab] -> (logprob of ``token_id``, the ``top_k`` most likely [(id, logprob)])."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_k > 0:
        values, ids = torch.topk(logp, top_k)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    return float(logp[token_id]), top
