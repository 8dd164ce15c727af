"""What this machine is and how this process runs on it: CPU features, and the OpenMP and glibc
allocator settings the `kvblend` command applies before torch loads (docs/cpu-tuning.md)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from kvblend import env

# CPU features that make bf16 prefill pay: AMX tiles (the amx attention kernel) or AVX-512 BF16 (Zen
# 4: the avx512bf16 kernel; one 6,254-token prompt, interleaved, took 8.0 s for full prefill in bf16
# against 17.8 s in fp32, 1.5 s for blend@0.15 against 3.3 s). Without any native bf16 oneDNN
# emulates it, several times slower than fp32 (measured 7.6x on an AVX2-only EPYC).
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in /proc/cpuinfo ("" where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((l for l in text.splitlines() if l.startswith(name)), "")
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """Feature flags of this CPU from /proc/cpuinfo (empty where it cannot be read)."""
    return set(_cpuinfo_field("flags").split())


def cpu_model_name() -> str:
    """This CPU's model name from /proc/cpuinfo ("" where it cannot be read)."""
    return _cpuinfo_field("model name")


# PyTorch's OpenMP threads spin this many rounds after an op before they sleep (GNU OpenMP). On 2
# vCPUs, sleeping at once (OMP_WAIT_POLICY=PASSIVE) made blend@0.15 5-9% and reuse ~11% slower. The
# default endless spin starved the native kernels' threads: blend@0.15 took 792 ms against 638 with
# PASSIVE (docs/cpu-tuning.md).
OPENMP_SPIN_COUNT = "10000"


def apply_openmp_defaults() -> bool:
    """Set GOMP_SPINCOUNT before torch loads OpenMP, unless the user chose a wait policy or spin
    count. Returns whether it was set. Too late (no effect) once torch is imported."""
    if env.is_set("OMP_WAIT_POLICY"):
        return False
    return env.set_default("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


# glibc hands freed blocks above its (adaptive) thresholds back to the OS, and a prefill frees and
# allocates tens of MB a layer, so every request faults its working memory in again: a full prefill
# of a 6,254-token prompt (SmolLM2, bf16) took ~156,000 minor page faults, blend@0.15 ~10,700.
# Taking blocks under MALLOC_MMAP_BYTES from the heap and keeping up to MALLOC_TRIM_BYTES of it
# freed: 706 and 2 faults, full 2,045 -> 1,901 ms, blend@0.15 463 -> 445 (docs/cpu-tuning.md). The
# freed memory stays with the process.
MALLOC_MMAP_BYTES = 256 << 20
MALLOC_TRIM_BYTES = 1 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def apply_malloc_defaults() -> bool:
    """Set glibc's mmap and trim thresholds (``mallopt``) for this process, unless the user set
    glibc's own MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_. Returns whether it was set
    (False off glibc)."""
    if env.is_set("MALLOC_MMAP_THRESHOLD_") or env.is_set("MALLOC_TRIM_THRESHOLD_"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES)
    )
