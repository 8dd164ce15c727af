"""What ``/v1/models`` and ``kvblend_model_info`` say about a backend, whatever its kind."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvblend_version() -> str:
    try:
        return version("kvblend")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.1.0+local"


def max_model_len(backend) -> int | None:
    """The context window in tokens of a local model; None for an upstream (not known here)."""
    engine = getattr(backend, "engine", None)
    n = getattr(engine, "max_context_len", None)
    return int(n) if n else None


def model_info(backend) -> dict[str, str]:
    """Labels of the info metric: version, model, dtype, attention kernel."""
    engine = getattr(backend, "engine", None)
    ops = getattr(engine, "ops", None)
    dtype = str(getattr(ops, "dtype", "")).removeprefix("torch.") if ops is not None else ""
    return {
        "model_name": backend.id,
        "version": kvblend_version(),
        "backend": "local" if engine is not None else "upstream",
        "dtype": dtype or "unknown",
        "attention_kernel": str(getattr(engine, "attention_kernel", "")) or "none",
    }
