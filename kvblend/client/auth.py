"""Endpoint settings from ``auth.json`` profiles, with environment overrides.

File format::

    {"base_url": "http://127.0.0.1:8000/v1", "api_key": "sk-...",
     "model_id": "smollm2-135m-instruct", "timeout": 60, "max_retries": 2,
     "profiles": {"vllm": {"base_url": "http://127.0.0.1:8001/v1"}}}

A profile inherits every top-level key it does not set. Lookup order: ``--auth PATH``,
``./auth.json``, ``<user config dir>/kvblend/auth.json``; then ``KVBLEND_BASE_URL`` / ``_API_KEY`` /
``_MODEL_ID`` override. API keys never appear in output: ``Endpoint`` hides the key from ``repr``
and ``mask_key`` shortens it.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvblend.config import CLIENT_ENV_VARS, client_env_overrides, default_config_dir

AUTH_FILENAME = "auth.json"
SETTING_KEYS = ("base_url", "api_key", "model_id", "timeout", "max_retries")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_RETRIES = 2


class AuthError(ValueError):
    """A missing or invalid auth.json / profile; the CLI prints it as one line."""


def mask_key(key: str) -> str:
    """``sk-...abcd``: enough to tell keys apart, never enough to use one."""
    if not key:
        return "(none)"
    stripped = key.strip()
    head = stripped[:3] if len(stripped) > 12 else ""
    tail = stripped[-4:] if len(stripped) > 8 else ""
    masked = f"{head}...{tail}" if tail else "***"
    if stripped != key:
        masked += " (with surrounding whitespace)"
    return masked


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible endpoint as resolved from auth.json + environment."""

    name: str  # label in reports and tables
    base_url: str
    api_key: str = field(default="", repr=False)
    model_id: str = ""
    timeout: float = DEFAULT_TIMEOUT_S
    max_retries: int = DEFAULT_MAX_RETRIES
    source: str = ""  # where the settings came from, for messages

    @property
    def masked_key(self) -> str:
        return mask_key(self.api_key)

    def public_dict(self) -> dict:
        """What reports may record: everything but the key."""
        return {
            "name": self.name,
            "base_url": self.base_url,
            "model_id": self.model_id,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "source": self.source,
        }


def find_auth_file(
    explicit: str | Path | None, cwd: Path | None = None, config_dir: Path | None = None
) -> Path | None:
    """The auth.json to use, or None when there is none (environment variables
    may still suffice)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise AuthError(f"auth file not found: {path}")
        return path
    for candidate in (
        (cwd or Path.cwd()) / AUTH_FILENAME,
        (config_dir or default_config_dir()) / AUTH_FILENAME,
    ):
        if candidate.is_file():
            return candidate
    return None


def _check_settings(settings: dict, where: str) -> dict:
    unknown = sorted(set(settings) - set(SETTING_KEYS))
    if unknown:
        raise AuthError(
            f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(SETTING_KEYS)}"
        )
    for key in ("base_url", "api_key", "model_id"):
        if key in settings and not isinstance(settings[key], str):
            raise AuthError(f"{where}: {key} must be a string")
    if "timeout" in settings:
        t = settings["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise AuthError(f"{where}: timeout must be a positive number of seconds, got {t!r}")
    if "max_retries" in settings:
        r = settings["max_retries"]
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise AuthError(f"{where}: max_retries must be an integer >= 0, got {r!r}")
    return settings


def read_auth_file(path: Path) -> dict:
    """Parsed and validated auth.json: {"settings": {...top level}, "profiles": {name: {...}}}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AuthError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except OSError as e:
        raise AuthError(f"{path}: cannot read: {e.strerror}") from None
    if not isinstance(data, dict):
        raise AuthError(f"{path}: expected a JSON object with base_url, api_key, model_id")
    profiles = data.pop("profiles", {}) or {}
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise AuthError(f"{path}: 'profiles' must map names to objects")
    settings = _check_settings(data, str(path))
    checked = {
        name: _check_settings(dict(p), f"{path} profile {name!r}") for name, p in profiles.items()
    }
    return {"settings": settings, "profiles": checked}


def _default_label(base_url: str) -> str:
    parts = urlsplit(base_url)
    return parts.netloc or base_url


def load_endpoint(
    auth: str | Path | None = None,
    profile: str | None = None,
    env: dict | None = None,
    cwd: Path | None = None,
    config_dir: Path | None = None,
) -> Endpoint:
    """Resolve one endpoint. ``env`` defaults to ``client_env_overrides()`` (pass {} to ignore
    the environment)."""
    path = find_auth_file(auth, cwd=cwd, config_dir=config_dir)
    parsed = read_auth_file(path) if path else {"settings": {}, "profiles": {}}
    settings = dict(parsed["settings"])
    source = str(path) if path else "environment"
    if profile:
        if profile not in parsed["profiles"]:
            offered = ", ".join(sorted(parsed["profiles"])) or "none"
            where = path or "no auth.json found"
            raise AuthError(f"profile {profile!r} not in {where} (profiles: {offered})")
        settings.update(parsed["profiles"][profile])
        source += f" profile {profile!r}"
    overrides = client_env_overrides() if env is None else env
    if overrides:
        settings.update(overrides)
        source += " + env " + ",".join(v for v, k in CLIENT_ENV_VARS.items() if k in overrides)
    base_url = str(settings.get("base_url", "")).strip()
    if not base_url:
        looked = (
            f"--auth, ./{AUTH_FILENAME}, {(config_dir or default_config_dir()) / AUTH_FILENAME}"
        )
        why = f"{path} has no base_url" if path else f"no auth.json found (looked in {looked})"
        raise AuthError(f"{why}; set base_url there or KVBLEND_BASE_URL")
    return Endpoint(
        name=profile
        or (path.stem if path and path.name != AUTH_FILENAME else _default_label(base_url)),
        base_url=base_url.rstrip("/"),
        api_key=settings.get("api_key", ""),
        model_id=settings.get("model_id", "").strip(),
        timeout=float(settings.get("timeout", DEFAULT_TIMEOUT_S)),
        max_retries=int(settings.get("max_retries", DEFAULT_MAX_RETRIES)),
        source=source,
    )


def add_endpoint_arguments(parser: argparse.ArgumentParser, multiple: bool = False) -> None:
    """``--auth`` / ``--profile``; with ``multiple`` both repeat to compare
    endpoints side by side."""
    action = "append" if multiple else "store"
    more = " (repeat to compare several)" if multiple else ""
    parser.add_argument(
        "--auth",
        action=action,
        metavar="PATH",
        help=f"auth.json file{more}; default ./auth.json, then ~/.config/kvblend/auth.json",
    )
    parser.add_argument(
        "--profile", action=action, metavar="NAME", help=f"profile inside auth.json{more}"
    )


def endpoints_from_args(args: argparse.Namespace) -> list[Endpoint]:
    """Every (auth file x profile) pair named on the command line; labels made unique."""
    auths = args.auth if isinstance(args.auth, list) else [args.auth]
    profiles = args.profile if isinstance(args.profile, list) else [args.profile]
    endpoints = [load_endpoint(a, p) for a in (auths or [None]) for p in (profiles or [None])]
    if len(endpoints) > 1 and client_env_overrides():
        # Env overrides apply to every profile, so side-by-side endpoints may silently become one.
        logging.getLogger(__name__).warning(
            "KVBLEND_BASE_URL/_API_KEY/_MODEL_ID override every compared endpoint"
        )
    seen: dict[str, int] = {}
    unique = []
    for ep in endpoints:
        seen[ep.name] = seen.get(ep.name, 0) + 1
        label = ep.name if seen[ep.name] == 1 else f"{ep.name}#{seen[ep.name]}"
        unique.append(
            Endpoint(
                label, ep.base_url, ep.api_key, ep.model_id, ep.timeout, ep.max_retries, ep.source
            )
        )
    return unique
