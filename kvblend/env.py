"""Every environment variable kvblend reads, typed, in one registry: the only module that reads
``os.environ``.

Callers ask by name: ``env.read("KVBLEND_THREADS")`` gives the parsed value or the variable's
default; a malformed value is a ``ValueError`` naming the variable. An upstream model's key is
read from the variable its config entry names (``read_secret``): the operator chooses that name,
so it is not listed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    deprecated_by: str = ""  # the variable that replaces this one


REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "KVBLEND_MODEL", str, "", "weights (HF dir or .gguf); empty: the embedded SmolLM2-135M"
        ),
        EnvVar("KVBLEND_DTYPE", str, "auto", "auto | bfloat16 | float32 | float16"),
        EnvVar(
            "KVBLEND_THREADS", _whole_number, 0, "torch threads for an engine; 0: torch's default"
        ),
        EnvVar("KVBLEND_ATTENTION_KERNEL", str, "auto", "auto | amx | avx512bf16 | avx2 | torch"),
        EnvVar("KVBLEND_CACHE_DIR", Path, None, "converted weights, kernels and the disk tier"),
        EnvVar("KVBLEND_STORE_TIERS", _names, (), "store tiers in lookup order, e.g. memory,disk"),
        EnvVar("KVBLEND_STORE_DIR", Path, None, "the disk tier's directory"),
        EnvVar("KVBLEND_REDIS_URL", str, "", "the Redis tier's URL"),
        EnvVar("KVBLEND_SERVER_API_KEYS", _names, (), "server keys: key[:namespace],..."),
        EnvVar("KVBLEND_API_KEYS", _names, (), "server keys (old name)", "KVBLEND_SERVER_API_KEYS"),
        EnvVar("KVBLEND_BASE_URL", str, "", "client: endpoint base URL (overrides auth.json)"),
        EnvVar("KVBLEND_CLIENT_API_KEY", str, "", "client: bearer key (overrides auth.json)"),
        EnvVar(
            "KVBLEND_API_KEY", str, "", "client: bearer key (old name)", "KVBLEND_CLIENT_API_KEY"
        ),
        EnvVar("KVBLEND_MODEL_ID", str, "", "client: model id (overrides auth.json)"),
        EnvVar("XDG_CACHE_HOME", Path, None, "cache root when KVBLEND_CACHE_DIR is unset"),
        EnvVar("XDG_CONFIG_HOME", Path, None, "config root (auth.json)"),
        EnvVar("CC", str, "gcc", "the C compiler that builds the native kernels"),
        # The C runtime's own settings: kvblend sets its defaults only where the user chose none.
        EnvVar("GOMP_SPINCOUNT", str, "", "GNU OpenMP: rounds a thread spins before it sleeps"),
        EnvVar("OMP_WAIT_POLICY", str, "", "OpenMP: ACTIVE or PASSIVE waiting"),
        EnvVar("MALLOC_MMAP_THRESHOLD_", str, "", "glibc: allocations above this use mmap"),
        EnvVar(
            "MALLOC_TRIM_THRESHOLD_", str, "", "glibc: freed heap above this goes back to the OS"
        ),
    )
}

_warned: set[str] = set()


def is_set(name: str) -> bool:
    return bool(os.environ.get(_known(name).name))


def read(name: str) -> Any:
    """The parsed value of ``name``, or its default when unset or empty. A deprecated variable warns
    once on stderr, naming its replacement."""
    var = _known(name)
    text = os.environ.get(var.name)
    if not text:
        return var.default
    if var.deprecated_by:
        warn_once(f"{var.name} is deprecated: export {var.deprecated_by} instead")
    try:
        return var.parse(text)
    except ValueError as e:
        raise ValueError(f"{var.name}: {e}") from None


def read_secret(name: str) -> str:
    """The value of the variable a config entry names (``api_key_env``); "" when
    unnamed or unset."""
    return os.environ.get(name, "") if name else ""


def set_default(name: str, value: str) -> bool:
    """Set a registered variable for this process and its children unless the user set it."""
    if is_set(name):
        return False
    os.environ[_known(name).name] = value
    return True


def child_environ(prepend_path: str = "") -> dict[str, str]:
    """This process's environment for a child Python, with ``prepend_path`` first
    on its PYTHONPATH."""
    child = dict(os.environ)
    if prepend_path:
        child["PYTHONPATH"] = os.pathsep.join(filter(None, [prepend_path, child.get("PYTHONPATH")]))
    return child


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"kvblend: warning: {message}", file=sys.stderr)


def _known(name: str) -> EnvVar:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered kvblend variable (kvblend/env.py)") from None
