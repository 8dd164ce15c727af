"""Server config files (YAML or TOML, same shape) -> ``ServerConfig``.

Precedence, lowest first: dataclass defaults < config file < environment (server keys, store tiers,
directory and Redis URL) < CLI flags.
Unknown keys are errors, not silently ignored: a typo in a key name would otherwise serve the wrong
thing.

    host: 127.0.0.1
    port: 8000
    max_queue: 64
    max_batch: 8
    api_keys:
      - {key: sk-team-a, name: team-a, namespace: team-a}
    store: {tiers: [memory, disk], disk_dir: /var/cache/kvblend/kv}
    models:
      - {id: smollm2-135m-instruct, model: "", mode: blend, recompute_ratio: 0.15}
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import yaml

from kvblend.config import (
    ApiKey,
    ModelEntry,
    ServerConfig,
    StoreConfig,
    create_model_entry,
    load_env_overrides,
    load_server_env,
)

STORE_ENV_FIELDS = ("tiers", "disk_dir", "redis_url")


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".toml":
        data = tomllib.loads(text)
    else:
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return data


def _check_keys(cls, data: dict, where: str) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(names)}")
    return data


def _model_entry(data: Any, i: int) -> ModelEntry:
    if isinstance(data, str):  # shorthand: a bare weights path
        return create_model_entry(f"models[{i}]", model=data)
    if not isinstance(data, dict):
        raise ValueError(f"models[{i}] must be a mapping or a weights path")
    if "api_key" in data:  # secrets stay out of config files
        raise ValueError(
            f"models[{i}]: do not put an upstream key in the config file; export it in an "
            "environment variable and name that variable with api_key_env"
        )
    return create_model_entry(f"models[{i}]", **data)


def _api_key(data: Any, i: int) -> ApiKey:
    if isinstance(data, str):
        return ApiKey(key=data, name=f"key{i}")
    if not isinstance(data, dict):
        raise ValueError(f"api_keys[{i}] must be a mapping or a string")
    return ApiKey(**_check_keys(ApiKey, dict(data), f"api_keys[{i}]"))


def server_config_from_dict(data: dict[str, Any]) -> ServerConfig:
    data = dict(_check_keys(ServerConfig, dict(data), "config"))
    if "models" in data:
        models = data["models"]
        if isinstance(models, dict):  # {id: {...}} mapping form
            models = [
                {"id": k, **(v or {})} if isinstance(v, dict) else {"id": k, "model": v}
                for k, v in models.items()
            ]
        data["models"] = [_model_entry(m, i) for i, m in enumerate(models or [])]
    if "api_keys" in data:
        data["api_keys"] = [_api_key(k, i) for i, k in enumerate(data["api_keys"] or [])]
    if "store" in data:
        data["store"] = StoreConfig(**_check_keys(StoreConfig, dict(data["store"] or {}), "store"))
    return ServerConfig(**data)


def load_server_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ServerConfig:
    """File (optional) + environment + explicit overrides (CLI flags; None values are skipped)."""
    data = read_config_file(path) if path else {}
    store_env = {k: v for k, v in load_env_overrides().items() if k in STORE_ENV_FIELDS}
    if store_env:  # KVBLEND_STORE_TIERS / _STORE_DIR / _REDIS_URL override the file's store section
        data["store"] = {**(data.get("store") or {}), **store_env}
    env = load_server_env()
    if env.get(
        "api_keys"
    ):  # env keys add to the file's, so a deployment can inject a secret without editing it
        data["api_keys"] = list(data.get("api_keys") or []) + [
            dataclasses.asdict(k) for k in env["api_keys"]
        ]
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return server_config_from_dict(data)
