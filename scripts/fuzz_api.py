"""Fuzz a running kvblend server with schemathesis over its whole /openapi.json (a bench, not CI).

    kvblend serve --api-key sk-fuzz &
    python scripts/fuzz_api.py http://127.0.0.1:8000 --key sk-fuzz --max-examples 9000

Every operation gets up to ``--max-examples`` generated requests. Only the 6 POST operations have
inputs enough to reach it (the GETs without parameters run out of new cases after a few), so 9,000
gives 54,000 plus schemathesis' own coverage and stateful phases; generated ``max_tokens`` are
capped at 16 by a hook in this file, or streamed answers of thousands of tokens stall the run. The
checks are the issue's targets: no 5xx, every status documented, every content type and body as the
schema says. The exit status is schemathesis'; its JUnit report goes to ``--report-dir``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

MAX_TOKENS = 16  # generated max_tokens are capped: a streamed 8k-token answer takes minutes here

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base_url", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--key", default="", help="an API key the server accepts (bearer token)")
    p.add_argument("--max-examples", type=int, default=9000, help="requests per operation")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--report-dir", default="bench/results/fuzz")
    argv = sys.argv[1:]
    # after "--": schemathesis flags, e.g. -- --include-path-regex '^/v1/messages$', to split the
    # operations over two processes (schemathesis generates cases on one core)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = p.parse_args(argv[:cut]), argv[cut + 1 :]
    here = Path(sys.executable).parent  # the venv this script runs in, even when it is not on PATH
    exe = shutil.which("schemathesis", path=str(here)) or shutil.which("schemathesis")
    if exe is None:
        print(
            "fuzz_api: schemathesis is not installed (pip install 'kvblend[test]')", file=sys.stderr
        )
        return 2
    cmd = [
        exe,
        "run",
        args.base_url.rstrip("/") + "/openapi.json",
        "--checks",
        CHECKS,
        "--max-examples",
        str(args.max_examples),
        "--workers",
        str(args.workers),
        "--continue-on-failure",
        "--report",
        "junit",
        "--report-dir",
        args.report_dir,
        "--request-timeout",
        "120",
    ]
    if args.key:
        cmd += ["-H", f"Authorization: Bearer {args.key}"]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    cmd += extra
    # this file is also the hooks module: schemathesis imports it by name from its directory
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "SCHEMATHESIS_HOOKS": Path(__file__).stem, "PYTHONPATH": path}
    return subprocess.call(cmd, env=env)


def _register_hooks() -> None:
    try:
        import schemathesis
    except ImportError:
        return

    @schemathesis.hook
    def map_body(context, body):
        if isinstance(body, dict):
            for name in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(name), int) and body[name] > MAX_TOKENS:
                    body[name] = MAX_TOKENS
        return body


if __name__ != "__main__":  # imported by schemathesis as SCHEMATHESIS_HOOKS
    _register_hooks()


if __name__ == "__main__":
    raise SystemExit(main())
