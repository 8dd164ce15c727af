"""``kvblend doctor``: check an OpenAI-style endpoint from auth.json, one line per check, each
failure with its fix.

Checks run in order and later ones are skipped once one they depend on fails:
reachable -> /v1 path -> key accepted -> model id exists -> streaming parses -> one-token TTFT.
The raw HTTP checks use httpx (to see status codes and bodies as they are); the streaming checks use
the same openai-based helper the benchmarks use, so a PASS means ``kvblend bench`` will work too.
"""

from __future__ import annotations

import argparse
import errno
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvblend.client.auth import Endpoint, add_endpoint_arguments, load_endpoint

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
PROBE_MESSAGES = [{"role": "user", "content": "Reply with one word: hello."}]


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status}  {self.name:<19} {self.detail}"
        return text + (f" -> fix: {self.fix}" if self.fix else "")


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from (httpx wraps httpcore wraps OSError)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def classify_network_error(exc: BaseException, base_url: str) -> tuple[str, str]:
    """(what failed, how to fix it) for a request that got no HTTP response at all."""
    import httpx

    parts = urlsplit(base_url)
    where = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    if isinstance(exc, httpx.UnsupportedProtocol):
        return (
            f"base_url {base_url!r} has no http:// or https:// scheme",
            "write base_url as http://HOST:PORT/v1",
        )
    if any(isinstance(e, httpx.TimeoutException) or isinstance(e, TimeoutError) for e in chain):
        return (
            f"network failure: timed out talking to {where}",
            "check host/port and any firewall or proxy; a busy server may need a larger "
            "timeout in auth.json",
        )
    if any(isinstance(e, socket.gaierror) for e in chain) or any(
        s in text
        for s in (
            "Name or service not known",
            "nodename nor servname",
            "Temporary failure in name",
            "No address associated",
            "getaddrinfo failed",
        )
    ):
        return (
            f"network failure: DNS lookup failed for host {parts.hostname!r}",
            "check the host name in base_url (typo? VPN? use an IP address)",
        )
    if any(isinstance(e, ssl.SSLError) for e in chain) or "SSL" in text or "CERTIFICATE" in text:
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return (
                f"network failure: TLS certificate of {where} is not trusted",
                "install a trusted certificate, or use http:// for a local server",
            )
        return (
            f"network failure: TLS handshake with {where} failed ({str(chain[-1])[:80]})",
            "the server probably speaks plain HTTP: use http:// in base_url",
        )
    if (
        any(isinstance(e, ConnectionRefusedError) for e in chain)
        or "Connection refused" in text
        or any(getattr(e, "errno", None) == errno.ECONNREFUSED for e in chain)
    ):
        return (
            f"network failure: connection refused at {where} (nothing is listening there)",
            "start the server (e.g. `kvblend serve`) or fix the port in base_url",
        )
    return (
        f"network failure: {type(exc).__name__}: {text[:160]}",
        "check base_url and that the server is running",
    )


def _error_message(response) -> str:
    """The server's error text, from OpenAI's {"error": {"message"}} shape or whatever it sent."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:120].strip()
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:160]
        return str(err)[:160]
    return str(body)[:160]


def _models_from(response) -> list[str] | None:
    """Model ids of a /models answer, or None when the body is not OpenAI's list shape."""
    try:
        body = response.json()
    except ValueError:
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return [str(m.get("id")) for m in data if isinstance(m, dict) and "id" in m]


def _path_fix(base_url: str, http) -> str:
    """Suggest the base_url most likely meant when /models was not found."""
    trimmed = base_url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        if trimmed.endswith(suffix):
            return f"base_url is the API root, not an endpoint: use {trimmed[: -len(suffix)]}"
    if not trimmed.endswith("/v1"):
        try:
            probe = http.get(trimmed + "/v1/models")
            if probe.status_code != 404:
                return (
                    f"base_url is missing /v1: use {trimmed}/v1 (that path answers "
                    f"{probe.status_code})"
                )
        except Exception:  # noqa: BLE001 - only a suggestion
            pass
        return f"base_url should end with the API prefix, usually /v1: try {trimmed}/v1"
    return (
        "the server has no /v1/models; check its API prefix (is this an OpenAI-compatible server?)"
    )


def check_key(endpoint: Endpoint, http, models_url: str) -> tuple[Check, object | None]:
    """Send the key as ``Authorization: Bearer <key>``; on 401 work out why and
    confirm when possible."""
    import httpx

    key = endpoint.api_key
    if not key:
        return Check(
            "key accepted",
            FAIL,
            "server requires a key and api_key is empty",
            "set api_key in auth.json (or KVBLEND_CLIENT_API_KEY)",
        ), None
    try:
        r = http.get(models_url, headers={"Authorization": f"Bearer {key}"})
    except httpx.LocalProtocolError:
        r = None  # a newline or control character makes the header unsendable
    if r is not None and r.status_code < 400:
        return Check("key accepted", PASS, f"key {endpoint.masked_key} accepted"), r
    status = "unsendable header" if r is None else f"{r.status_code} {_error_message(r)!r}"

    def works(candidate: str) -> bool:
        try:
            return (
                http.get(models_url, headers={"Authorization": f"Bearer {candidate}"}).status_code
                < 400
            )
        except httpx.HTTPError:
            return False

    if key != key.strip():
        confirmed = " (confirmed: the stripped key is accepted)" if works(key.strip()) else ""
        return Check(
            "key accepted",
            FAIL,
            f"{status}: api_key has stray whitespace or a line break{confirmed}",
            f"remove the whitespace around api_key in {endpoint.source}",
        ), None
    if key.lower().startswith("bearer "):
        bare = key[len("bearer ") :].strip()
        confirmed = " (confirmed: the bare key is accepted)" if works(bare) else ""
        return Check(
            "key accepted",
            FAIL,
            f"{status}: api_key starts with 'Bearer '{confirmed}",
            "store the bare key; the client adds 'Authorization: Bearer ' itself",
        ), None
    if (
        r is not None
        and "bearer" in _error_message(r).lower()
        and "missing" in _error_message(r).lower()
    ):
        return Check(
            "key accepted",
            FAIL,
            f"{status}: the server saw no Bearer token",
            "a proxy may strip the Authorization header; the header must read "
            "'Authorization: Bearer <key>'",
        ), None
    return Check(
        "key accepted",
        FAIL,
        f"{status}: wrong key ({endpoint.masked_key} rejected)",
        "use the key the server was started with; clients must send 'Authorization: Bearer <key>'",
    ), None


def _stream_checks(endpoint: Endpoint, model: str, offered: list[str] | None) -> list[Check]:
    import asyncio

    from kvblend.client.stream import ChatRequest, make_async_client, stream_chat

    async def probe() -> tuple:
        client = make_async_client(
            endpoint, max_retries=0
        )  # doctor reports failures, it does not hide them
        try:
            first = await stream_chat(client, model, ChatRequest(PROBE_MESSAGES, max_tokens=8))
            one = (
                await stream_chat(client, model, ChatRequest(PROBE_MESSAGES, max_tokens=1))
                if first.ok
                else None
            )
            return first, one
        finally:
            await client.close()

    first, one = asyncio.run(probe())
    checks: list[Check] = []
    if not first.ok:
        fix = "see the error; run with -v for the full trace"
        if first.status_code == 404:
            fix = (
                f"model {model!r} not found: use one of {', '.join(offered)}"
                if offered
                else "check model_id and the chat/completions path"
            )
        elif first.status_code in (401, 403):
            fix = "the key is rejected for chat completions: check api_key and its permissions"
        elif first.status_code == 400 and "stream_options" in (first.error or ""):
            fix = "the server rejects stream_options; it is too old for usage reporting"
        elif first.error and first.error.startswith("network failure"):
            fix = "the server dropped the stream: check its log"
        checks.append(Check("streaming parses", FAIL, first.error or "", fix))
    elif not first.text:
        checks.append(
            Check(
                "streaming parses",
                FAIL,
                f"{first.chunks} chunks but no choices[0].delta.content text",
                "the server must stream content in choices[0].delta.content",
            )
        )
    else:
        usage = "usage reported" if first.prompt_tokens is not None else "no usage in stream"
        cached = "cached_tokens reported" if first.cached_tokens is not None else "no cached_tokens"
        tolerated = (
            f", {first.empty_choice_chunks} empty-choices chunk(s) skipped"
            if first.empty_choice_chunks
            else ""
        )
        checks.append(
            Check(
                "streaming parses",
                PASS,
                f"{first.chunks} chunks, text {first.text[:40]!r}, {usage}, {cached}{tolerated}",
            )
        )
    if one is None:
        checks.append(Check("one-token TTFT", SKIP, "needs: streaming parses"))
    elif one.ok and one.ttft_s is not None:
        checks.append(
            Check(
                "one-token TTFT",
                PASS,
                f"{one.ttft_s * 1000:.0f} ms to first token (request total "
                f"{one.total_s * 1000:.0f} ms)",
            )
        )
    else:
        checks.append(
            Check(
                "one-token TTFT",
                FAIL,
                one.error or "no content token arrived with max_tokens=1",
                "the server must send the first token as a content delta",
            )
        )
    return checks


def run_checks(endpoint: Endpoint) -> list[Check]:
    import httpx

    checks: list[Check] = []
    names = [
        "endpoint reachable",
        "/v1 path",
        "key accepted",
        "model id exists",
        "streaming parses",
        "one-token TTFT",
    ]

    def skip_rest(reason: str) -> list[Check]:
        done = {c.name for c in checks}
        return checks + [Check(n, SKIP, f"needs: {reason}") for n in names if n not in done]

    models_url = endpoint.base_url.rstrip("/") + "/models"
    timeout = httpx.Timeout(endpoint.timeout, connect=min(endpoint.timeout, 10.0))
    with httpx.Client(timeout=timeout) as http:
        # 1. reachable: any HTTP answer at all. Sent without a key so a bad key
        #    cannot mask this step.
        try:
            anon = http.get(models_url)
        except httpx.HTTPError as e:
            detail, fix = classify_network_error(e, endpoint.base_url)
            checks.append(Check(names[0], FAIL, detail, fix))
            return skip_rest(names[0])
        elapsed = anon.elapsed.total_seconds() * 1000
        checks.append(
            Check(
                names[0], PASS, f"HTTP {anon.status_code} from GET {models_url} in {elapsed:.0f} ms"
            )
        )

        # 2. path: /models must exist and answer like an OpenAI API.
        if anon.status_code in (404, 405):
            checks.append(
                Check(
                    names[1],
                    FAIL,
                    f"GET {models_url} -> {anon.status_code} (no such path)",
                    _path_fix(endpoint.base_url, http),
                )
            )
            return skip_rest(names[1])
        needs_key = anon.status_code in (401, 403)
        if not needs_key and (anon.status_code >= 400 or _models_from(anon) is None):
            kind = anon.headers.get("content-type", "?")
            checks.append(
                Check(
                    names[1],
                    FAIL,
                    f"GET {models_url} -> {anon.status_code} {kind}, not an OpenAI model list",
                    _path_fix(endpoint.base_url, http),
                )
            )
            return skip_rest(names[1])
        checks.append(
            Check(
                names[1],
                PASS,
                f"{models_url} answers"
                + (" (requires a key)" if needs_key else " with a model list"),
            )
        )

        # 3. key.
        if needs_key:
            key_check, listed = check_key(endpoint, http, models_url)
            checks.append(key_check)
            if key_check.status == FAIL:
                return skip_rest(names[2])
        else:
            listed = anon
            checks.append(
                Check(
                    names[2],
                    PASS,
                    "server does not require a key"
                    + (f" (configured {endpoint.masked_key} unused)" if endpoint.api_key else ""),
                )
            )

    # 4. model id.
    offered = _models_from(listed) if listed is not None else None
    if not endpoint.model_id:
        checks.append(
            Check(
                names[3],
                FAIL,
                "model_id is not set",
                f"set model_id to one of: {', '.join(offered or []) or '(server lists none)'}",
            )
        )
        return skip_rest(names[3])
    if offered is not None and endpoint.model_id not in offered:
        checks.append(
            Check(
                names[3],
                FAIL,
                f"model {endpoint.model_id!r} is not offered; the server offers: "
                f"{', '.join(offered) or '(none)'}",
                "set model_id to one of the offered ids",
            )
        )
        return skip_rest(names[3])
    checks.append(Check(names[3], PASS, f"{endpoint.model_id!r} is listed by /models"))

    # 5-6. streaming through the openai client, as the benchmarks use it.
    checks.extend(_stream_checks(endpoint, endpoint.model_id, offered))
    return checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_endpoint_arguments(parser, multiple=False)
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per request (default: auth.json's)"
    )


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    endpoint = load_endpoint(args.auth, args.profile)
    if args.timeout:
        endpoint = replace(endpoint, timeout=float(args.timeout))
    print(
        f"endpoint {endpoint.name}: {endpoint.base_url}  model={endpoint.model_id or '(unset)'}  "
        f"key={endpoint.masked_key}  [{endpoint.source}]"
    )
    checks = run_checks(endpoint)
    for check in checks:
        print(check.line())
    failed = sum(c.status == FAIL for c in checks)
    print(
        f"result: {failed} of {len(checks)} checks failed"
        if failed
        else f"result: all {len(checks)} checks passed"
    )
    return 1 if failed else 0
