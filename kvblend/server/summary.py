"""The one start-up summary `kvblend serve` prints once its models are loaded."""

from __future__ import annotations

from kvblend import __version__
from kvblend.config import ServerConfig
from kvblend.store.describe import describe_store


def describe_backend(backend) -> str:
    engine = getattr(backend, "engine", None)
    if engine is None:  # an upstream model
        return f"{backend.id}: upstream {getattr(backend, 'base_url', '')}"
    model_cfg = engine.config.model
    blend = engine.config.blend
    prefill = engine.default_policy.label
    if blend.fidelity is not None:
        prefill = f"fidelity {blend.fidelity:g} (else {prefill})"
    return (
        f"{backend.id}: {model_cfg.dtype} on {model_cfg.device}, attention "
        f"{engine.attention_kernel}, prefill {prefill}, context {engine.max_context_len}"
    )


def startup_summary(config: ServerConfig, backends, url: str) -> str:
    keys = len(config.api_keys)
    auth = f"on ({keys} key{'s' if keys != 1 else ''})" if keys else "off (no API keys configured)"
    lines = [f"kvblend {__version__} serving at {url}/v1"]
    lines += [f"  model {describe_backend(b)}" for b in backends]
    lines += [f"  auth: {auth}", f"  store: {describe_store(config.store)}"]
    return "\n".join(lines)
