"""Issue 33 F10 / F11: a full device frees space in the disk tier, and a chunk no tier can keep is
refused with a reason instead of being computed and dropped on every call."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys

import pytest
import torch

from kvblend.store.base import ChunkKV
from kvblend.store.disk import DiskStore
from kvblend.store.memory import MemoryStore

_FILL = """
import sys, torch
from kvblend.store.base import ChunkKV
from kvblend.store.disk import DiskStore
store = DiskStore(sys.argv[1], max_bytes=64 << 20, fsync=False)  # budget far above the 1 MiB device
kv = ChunkKV(torch.ones(2, 2, 64, 64), torch.ones(2, 2, 64, 64))  # ~128 KiB a file
written = []
for i in range(40):
    store.put(f"k{i}", kv)
    written.append(store.get(f"k{i}") is not None)
s = store.stats()
print(sum(written[:7]), sum(written[10:]), s["errors"], s["no_space"],
      s["evictions"] > 0 or s["entries"] < 40)
"""


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    return (
        subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
            capture_output=True,
        ).returncode
        == 0
    )


@pytest.mark.skipif(
    not _can_mount_tmpfs(), reason="needs unshare -rm (user + mount namespaces) for a real tmpfs"
)
def test_disk_tier_recovers_after_enospc_on_a_real_full_device(tmp_path):
    """A 1 MiB tmpfs in a private mount namespace: the byte budget (64 MiB) never triggers
    eviction, the device fills after ~7 entries, and every later write must still land (older
    entries make room)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_FILL)
    cmd = f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {script} {mnt}"
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    first, later, errors, no_space, _ = out.stdout.split()
    assert int(first) >= 5 and int(later) == 30, (
        out.stdout
    )  # every write after the device filled landed
    assert int(no_space) > 0 and int(errors) == 0


def test_disk_tier_recovers_after_enospc_simulated(tmp_path, monkeypatch):
    """The same on any machine: a device of 1 MiB stood in for by the file writes' own check."""
    store = DiskStore(tmp_path, max_bytes=64 << 20, fsync=False)
    real_write = DiskStore._write_file

    def write(self, tmp, parts):
        used = sum(p.stat().st_size for p in tmp_path.iterdir())
        if used + sum(len(p) for p in parts) > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, tmp, parts)

    monkeypatch.setattr(DiskStore, "_write_file", write)
    kv = ChunkKV(torch.ones(2, 2, 64, 64), torch.ones(2, 2, 64, 64))
    landed = []
    for i in range(30):
        store.put(f"k{i}", kv)
        landed.append(store.get(f"k{i}") is not None)
    assert all(landed) and store.stats()["no_space"] > 0 and store.stats()["errors"] == 0
    store.check_integrity()


def test_chunk_larger_than_every_budget_is_refused_with_a_reason():
    from fastapi.testclient import TestClient
    from helpers import embedded_engine

    from kvblend.config import ModelEntry, ServerConfig
    from kvblend.server.app import create_app
    from kvblend.server.backends import LocalBackend

    engine = embedded_engine("float32")
    saved = engine.store
    try:
        per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads, head_dim 64, fp32
        engine.store = MemoryStore(max_bytes=per_token * 10)
        assert engine.max_chunk_tokens() == 10
        cfg = ServerConfig(models=[ModelEntry(id="m")])
        app = create_app(cfg, backends=[LocalBackend(cfg.models[0], None, cfg, engine=engine)])
        with TestClient(app) as c:
            long_doc = " ".join(["word"] * 40)
            r = c.post("/v1/chunks", json={"documents": ["short text", long_doc]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (
                err["param"] == "documents[1]"
                and err["code"] == "chunk_too_large"
                and "budget" in err["message"]
            )
            r = c.post("/v1/chunks", json={"documents": ["short text", " \n\t "]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == ("documents[1]", "empty_document")
            r = c.post("/v1/chunks", json={"documents": ["short text"]})
            assert (
                r.status_code == 200
                and c.post("/v1/chunks", json={"documents": ["short text"]}).json()["data"][0][
                    "cached"
                ]
                is True
            )
    finally:
        engine.store = saved
