"""Native CPU kernels, compiled from C at first use and loaded with ctypes.

``rows_attention.c`` is one layer's attention for a sorted set of query rows with an exact causal
mask by absolute position: full prefill (every row) and CacheBlend's recomputed rows (scattered
through the prompt) both go through it. PyTorch's CPU flash kernel can only be handed scattered
rows in a few masked blocks, which computes and throws away a large share of the scores. Three
builds of that contract:

    amx         rows_attention.c                bfloat16, Intel AMX (Sapphire Rapids and later)
    avx512bf16  rows_attention.c -DKVB_NO_AMX bfloat16, AVX512-BF16 without AMX (AMD Zen 4 and
                later)
    avx2        rows_attention_f32.c float32, AVX2 + FMA (any x86-64 of the last decade, e.g. AMD
                Zen)

For a dtype with two builds the first whose CPU features are present is taken (amx, then
avx512bf16). The amx build also projects rows (``RowsAttention.linear``, amx_linear.h): oneDNN
parallelises some of a blend's ~1,000-row projections poorly on two threads. Both bf16 builds also
carry a layer's row-wise ops (``rms_norm``, ``silu_mul``, ``scatter_rows``; rows_elementwise.h), one
pass each where PyTorch makes several.

The shared object is built with the system C compiler into ``<cache_dir>/kernels/`` (keyed by a
digest of the source, flags and compiler version, written atomically) and needs no PyTorch
headers. Each build is compiled once per head size (``HEAD_DIMS``: 64 for SmolLM2 / Qwen2.5-0.5B,
128 for Qwen2.5-1.5B and the 7B-class models). Where it cannot be used (no compiler, a CPU without
the ISA, another head size) ``load_rows_attention`` says why (``KernelUnavailable.cause``) and
callers keep the PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvblend import env
from kvblend.platform import cpu_flags

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)  # the head sizes each build is compiled for (-DKVB_HEAD_DIM)
HEAD_DIM = HEAD_DIMS[0]  # the default build's


@dataclass(frozen=True)
class KernelSpec:
    """One build of the rows-attention contract: its source, compiler flags, the CPU features it
    needs and the tensor dtype it takes."""

    name: str
    source: str
    # Explicit ISA flags, not -march: the library is only loaded after /proc/cpuinfo
    # shows these features.
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    dtype: torch.dtype
    # Called once after loading, 0 = usable (AMX asks the OS for tile state);
    # None: nothing to set up.
    init_symbol: str | None = None


_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mfma")
_AVX512_CPU = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")
# Most preferred first within a dtype.
KERNEL_SPECS = (
    KernelSpec(
        "amx",
        "rows_attention.c",
        (
            "-O3",
            "-mtune=sapphirerapids",
            *_AVX512_FLAGS,
            "-mamx-tile",
            "-mamx-bf16",
            "-fPIC",
            "-shared",
            "-pthread",
        ),
        (*_AVX512_CPU, "amx_tile", "amx_bf16"),
        torch.bfloat16,
        "kvb_amx_init",
    ),
    KernelSpec(
        "avx512bf16",
        "rows_attention.c",
        ("-O3", *_AVX512_FLAGS, "-DKVB_NO_AMX", "-fPIC", "-shared", "-pthread"),
        _AVX512_CPU,
        torch.bfloat16,
    ),
    KernelSpec(
        "avx2",
        "rows_attention_f32.c",
        ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-pthread"),
        ("avx2", "fma"),
        torch.float32,
    ),
)
KERNELS_BY_NAME = {spec.name: spec for spec in KERNEL_SPECS}
# The self-check's exit status for "the kernel ran and gave wrong numbers" (selfcheck.py); any other
# failure (an import error, say) says nothing about the build, so it is not
# recorded against the build.
EXIT_MISMATCH = 3


def kernels_for(dtype: torch.dtype) -> tuple[KernelSpec, ...]:
    """The builds that take ``dtype`` tensors, most preferred first (empty: none)."""
    return tuple(spec for spec in KERNEL_SPECS if spec.dtype == dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KernelUnavailable(RuntimeError):
    """The native kernel cannot run here; the message says why (callers fall back to PyTorch).

    ``cause`` says whose it is: "cpu" (the CPU lacks the ISA), "os" (the OS refused the CPU state),
    "compiler" (no C compiler), "shape" (a head size or dtype no build takes) are the machine's
    or the model's; "build" (the compiler failed) and "selfcheck" (the build crashed or gave
    wrong numbers) are defects of the kernel or the toolchain, which tests must fail on and the
    engine warns about."""

    ENVIRONMENT_CAUSES = ("cpu", "os", "compiler", "shape")

    def __init__(self, message: str, cause: str = "build"):
        super().__init__(message)
        self.cause = cause

    @property
    def is_defect(self) -> bool:
        """True for a build that fails or fails its self-check (not the machine
        lacking something)."""
        return self.cause not in self.ENVIRONMENT_CAUSES


@dataclass
class RowsAttention:
    """ctypes binding of ``kvb_rows_attention`` (see rows_attention.c for the contract)."""

    lib: ctypes.CDLL
    path: Path
    spec: KernelSpec
    head_dim: int = HEAD_DIM  # the one head size this build attends (KVB_HEAD_DIM)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def scratch_bytes(self, num_keys: int, num_kv_heads: int) -> int:
        return int(self.lib.kvb_rows_attention_scratch_bytes(num_keys, num_kv_heads))

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rot: torch.Tensor | None,
        rope_half: tuple[torch.Tensor, torch.Tensor] | None,
        positions: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        scratch: torch.Tensor,
        num_threads: int,
        key_mass: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of rows at sorted ``positions`` [A] (int64) over keys [0, num_keys).

        q [A, Hq, d] pre-RoPE (rows may be strided, heads dense); k, v [Hkv, num_keys, d] (k
        pre-RoPE); k_rot [Hkv, num_keys, d] receives the rotated keys (the attention cache) or None;
        rope_half: fp32 (cos, sin) [>= num_keys, d/2] by position, or None when q and k are rotated;
        out [A, Hq * d] (rows may be strided). All of the kernel's dtype on the CPU. Returns
        ``out``. key_mass: fp32 [num_keys] (``has_key_mass`` builds): each key's attention
        probability, summed over the rows and query heads, is added to it."""
        num_rows, num_heads, d = q.shape
        num_kv_heads, num_keys, _ = k.shape
        self._check_head_dim(d)
        for t, name in ((q, "q"), (k, "k"), (v, "v"), (k_rot, "k_rot"), (out, "out")):
            if t is not None:
                self._check_tensor(t, name)
        if out.stride(-1) != 1 or out.shape != (num_rows, num_heads * d):
            raise ValueError(f"out must be [{num_rows}, {num_heads * d}] with dense rows")
        if (
            positions.dtype != torch.int64
            or not positions.is_contiguous()
            or positions.numel() != num_rows
        ):
            raise ValueError(
                "positions must be a contiguous int64 tensor with one entry per query row"
            )
        if num_rows and (
            int(positions[-1]) >= num_keys
            or int(positions[0]) < 0
            or bool((positions[1:] < positions[:-1]).any())
        ):
            raise ValueError(f"positions must be ascending within [0, {num_keys}) (the keys given)")
        cos = sin = None
        if rope_half is not None:
            cos, sin = rope_half
            if (
                cos.dtype != torch.float32
                or not cos.is_contiguous()
                or not sin.is_contiguous()
                or cos.shape[0] < num_keys
                or cos.shape[1] != d // 2
            ):
                raise ValueError("rope tables must be contiguous fp32 [>= num_keys, head_dim / 2]")
        args = (
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            None if k_rot is None else k_rot.data_ptr(),
            0 if k_rot is None else k_rot.stride(0),
            None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(),
            positions.data_ptr(),
            num_rows,
            num_keys,
            num_kv_heads,
            num_heads // num_kv_heads,
            d,
            scale,
            out.data_ptr(),
            out.stride(0),
            scratch.data_ptr(),
            scratch.numel(),
            max(1, num_threads),
        )
        if key_mass is None:
            rc = self.lib.kvb_rows_attention(*args)
        else:
            if not self.has_key_mass:
                raise ValueError(
                    f"the {self.name} kernel does not sum key mass (has_key_mass is False)"
                )
            if (
                key_mass.dtype != torch.float32
                or key_mass.device.type != "cpu"
                or not key_mass.is_contiguous()
                or key_mass.shape != (num_keys,)
            ):
                raise ValueError(
                    f"key_mass must be a contiguous float32 CPU tensor [{num_keys}] (one entry "
                    f"per key), got {key_mass.dtype} {tuple(key_mass.shape)} on {key_mass.device}"
                )
            rc = self.lib.kvb_rows_attention_mass(*args, key_mass.data_ptr())
        if rc != 0:
            raise ValueError(
                f"rows attention rejected its arguments (rc={rc}): rows={num_rows}, "
                f"keys={num_keys}, heads={num_heads}/{num_kv_heads}, head_dim={d}"
            )
        return out

    @property
    def has_key_mass(self) -> bool:
        """Whether this build sums each key's attention probability (``key_mass``):
        both bf16 builds do."""
        return hasattr(self.lib, "kvb_rows_attention_mass")

    @property
    def has_linear(self) -> bool:
        """Whether this build also projects rows (``linear``): the AMX build does (amx_linear.h)."""
        return hasattr(self.lib, "kvb_linear")

    def pack_linear(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> "PackedLinear | None":
        """``weight`` [N, K] (and bias [N]) in the layout ``linear`` reads, or None for a shape the
        kernel does not take (N and K must be multiples of 32) or a build without it."""
        num_out, num_in = weight.shape
        if not self.has_linear or weight.dtype != self.dtype or num_out % 32 or num_in % 32:
            return None
        w = weight.detach().contiguous()
        packed = torch.empty(num_out * num_in, dtype=self.dtype)
        if self.lib.kvb_linear_pack(w.data_ptr(), num_out, num_in, packed.data_ptr()) != 0:
            return None
        return PackedLinear(
            packed, num_out, num_in, None if bias is None else bias.detach().float().contiguous()
        )

    def linear(
        self,
        x: torch.Tensor,
        weight: "PackedLinear",
        num_threads: int,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] (dense rows) @ W^T + bias -> [M, N], fp32 accumulation, rounded once to bf16;
        with ``residual`` [M, N], residual + that (rounded again, as a separate add). Written into
        ``out`` ([M, N], dense rows) when given, else a new tensor."""
        if x.dtype != self.dtype or x.device.type != "cpu":
            raise ValueError(
                f"x must be a {dtype_name(self.dtype)} CPU tensor, got {x.dtype} on {x.device}"
            )
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != weight.num_in:
            raise ValueError(
                f"x must be [M, {weight.num_in}] with dense rows, got {tuple(x.shape)}"
            )
        if out is None:
            out = torch.empty(x.shape[0], weight.num_out, dtype=x.dtype)
        self._check_rows(out, "out", weight.num_out, x.shape[0])
        if residual is not None:
            self._check_rows(residual, "residual", weight.num_out, x.shape[0])
        bias = weight.bias
        rc = self.lib.kvb_linear(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            weight.num_in,
            weight.packed.data_ptr(),
            weight.num_out,
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(),
            out.stride(0),
            max(1, num_threads),
        )
        if rc != 0:
            raise ValueError(
                f"the linear kernel rejected [{x.shape[0]}, {weight.num_in}] x [{weight.num_out}, "
                f"{weight.num_in}]^T (rc={rc})"
            )
        return out

    @property
    def has_gemv(self) -> bool:
        """Whether this build projects a few rows reading the weight in place (``gemv``): both
        bf16 builds do (gemv.h)."""
        return hasattr(self.lib, "kvb_gemv")

    @property
    def gemv_max_rows(self) -> int:
        return int(self.lib.kvb_gemv_max_rows()) if self.has_gemv else 0

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        num_threads: int,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] (M <= ``gemv_max_rows``, dense rows) @ weight [N, K]^T (+ bias [N]) -> [M, N],
        rounded as ``linear`` rounds (once, then again after the ``residual`` add); the module's
        own weight (dense rows, rows may be strided), nothing packed. Into ``out`` when given."""
        num_out, num_in = weight.shape
        self._check_rows(x, "x", num_in)
        self._check_rows(weight, "weight", num_in)
        if not 1 <= x.shape[0] <= self.gemv_max_rows:
            raise ValueError(f"gemv takes 1 to {self.gemv_max_rows} rows, got {x.shape[0]}")
        if bias is not None:
            self._check_rows(bias.view(1, -1), "bias", num_out)
        if out is None:
            out = torch.empty(x.shape[0], num_out, dtype=x.dtype)
        self._check_rows(out, "out", num_out, x.shape[0])
        if residual is not None:
            self._check_rows(residual, "residual", num_out, x.shape[0])
        rc = self.lib.kvb_gemv(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            num_in,
            weight.data_ptr(),
            weight.stride(0) if num_out > 1 else num_in,
            num_out,
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(),
            out.stride(0),
            max(1, num_threads),
        )
        if rc != 0:
            raise ValueError(
                f"gemv rejected [{x.shape[0]}, {num_in}] x [{num_out}, {num_in}]^T (rc={rc})"
            )
        return out

    @property
    def has_decode(self) -> bool:
        """Whether this build attends one decoding row over rotated keys in place
        (``decode_attention``): both bf16 builds do (decode_attention.h)."""
        return hasattr(self.lib, "kvb_decode_attention")

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_threads: int
    ) -> torch.Tensor:
        """One query row over keys [0, n): q [Hq, d] rotated (heads may be strided, each dense), k,
        v [Hkv, n, d] with k rotated (dense rows; heads may be strided) -> [1, Hq * d]."""
        num_heads, d = q.shape
        num_kv_heads, num_keys, _ = k.shape
        self._check_head_dim(d)
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            self._check_tensor(t, name, dense_rows=name != "q")
        if q.stride(-1) != 1 or v.shape != k.shape or k.shape[2] != d or num_heads % num_kv_heads:
            raise ValueError(
                f"decode_attention needs q [Hq, d] with dense rows and k, v [Hkv, n, d] alike "
                f"(Hq a multiple of Hkv); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        out = torch.empty(1, num_heads * d, dtype=q.dtype)
        rc = self.lib.kvb_decode_attention(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            num_keys,
            num_kv_heads,
            num_heads // num_kv_heads,
            d,
            scale,
            out.data_ptr(),
            max(1, num_threads),
        )
        if rc != 0:
            raise ValueError(
                f"decode_attention rejected keys={num_keys}, heads={num_heads}/{num_kv_heads}, "
                f"head_dim={d} (rc={rc})"
            )
        return out

    @property
    def has_elementwise(self) -> bool:
        """Whether this build has the row-wise ops (``rms_norm``, ``silu_mul``, ``scatter_rows``):
        both bf16 builds do."""
        return hasattr(self.lib, "kvb_rms_norm")

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        num_threads: int,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm(x) * weight for x [S, D] -> (out [S, D], None); with ``delta`` [S, D] the
        residual add first: (RMSNorm(x + delta) * weight, x + delta). Rounded as the HF module
        rounds (rows_elementwise.h)."""
        rows, dim = x.shape
        self._check_rows(x, "x", dim)
        self._check_rows(weight.view(1, -1), "weight", dim)
        out = torch.empty(rows, dim, dtype=x.dtype)
        total = None
        if delta is not None:
            self._check_rows(delta, "delta", dim, rows)
            total = torch.empty(rows, dim, dtype=x.dtype)
        rc = self.lib.kvb_rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            None if total is None else total.data_ptr(),
            dim,
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            dim,
            rows,
            dim,
            max(1, num_threads),
        )
        if rc != 0:
            raise ValueError(
                f"rms_norm rejected [{rows}, {dim}] (rc={rc}; dim must be a multiple of 16)"
            )
        return out, total

    def silu_mul(self, gate_up: torch.Tensor, num_threads: int) -> torch.Tensor:
        """SiLU(gate) * up for gate_up [S, 2 * I] (gate columns first) -> [S, I]."""
        rows, width = gate_up.shape
        self._check_rows(gate_up, "gate_up", width)
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        rc = self.lib.kvb_silu_mul(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            width // 2,
            rows,
            width // 2,
            max(1, num_threads),
        )
        if rc != 0:
            raise ValueError(
                f"silu_mul rejected [{rows}, {width}] (rc={rc}; half the width must "
                "be a multiple of 16)"
            )
        return out

    def scatter_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        """dst[:, rows] = src for dst [H, T, d] (dense [T, d] per head; heads may be
        strided) and src [H, A, d] (rows and heads may be strided, each row dense); rows:
        [A] int64, contiguous."""
        num_heads, num_dst, width = dst.shape
        dense_dst = dst.stride(2) == 1 and (num_dst == 1 or dst.stride(1) == width)
        if (
            dst.dtype != self.dtype
            or src.dtype != self.dtype
            or not dense_dst
            or src.stride(-1) != 1
            or src.shape != (num_heads, rows.numel(), width)
            or rows.dtype != torch.int64
            or not rows.is_contiguous()
        ):
            raise ValueError(
                "scatter_rows needs dst [H, T, d] with dense rows, src [H, A, d] with dense rows "
                f"and int64 rows [A] ({self.dtype}); got {tuple(dst.shape)}, {tuple(src.shape)}"
            )
        rc = self.lib.kvb_scatter_rows(
            src.data_ptr(),
            src.stride(0),
            src.stride(1),
            rows.data_ptr(),
            rows.numel(),
            num_heads,
            width,
            dst.data_ptr(),
            dst.stride(0),
            num_dst,
        )
        if rc != 0:
            raise ValueError(f"scatter_rows: a row is outside [0, {num_dst})")

    def _check_rows(
        self, t: torch.Tensor, name: str, width: int, num_rows: int | None = None
    ) -> None:
        """t must be [rows, width] of the kernel's dtype on the CPU with dense rows; with
        ``num_rows``, as many rows as x (the call's input)."""
        if (
            t.dtype != self.dtype
            or t.device.type != "cpu"
            or t.dim() != 2
            or t.shape[1] != width
            or t.stride(1) != 1
            or (t.shape[0] > 1 and t.stride(0) < width)
        ):
            raise ValueError(
                f"{name} must be a {dtype_name(self.dtype)} CPU tensor [rows, {width}] with dense "
                f"rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"
            )
        if num_rows is not None and t.shape[0] != num_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, x {num_rows}")

    def _check_head_dim(self, d: int) -> None:
        if d != self.head_dim:
            raise ValueError(
                f"this {self.name} build attends head_dim {self.head_dim}, got {d} "
                f"(load_rows_attention(..., head_dim={d}) builds that one)"
            )

    def _check_tensor(self, t: torch.Tensor, name: str, dense_rows: bool = True) -> None:
        if t.dtype != self.dtype or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be a {dtype_name(self.dtype)} CPU tensor "
                f"(the {self.name} kernel), got {t.dtype} on {t.device}"
            )
        if name != "out" and dense_rows and (t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]):
            raise ValueError(
                f"{name} needs contiguous [*, rows, head_dim] rows, got strides {t.stride()}"
            )


@dataclass(frozen=True)
class PackedLinear:
    """A projection weight in AMX's pair-interleaved tiles (``RowsAttention.pack_linear``)."""

    packed: torch.Tensor  # [N * K] bf16
    num_out: int
    num_in: int
    bias: torch.Tensor | None  # [N] fp32

    def columns(self, start: int, end: int) -> "PackedLinear":
        """Output columns [start, end) (multiples of 32) as a weight of their own, a view: the
        packing is column block by column block (a fused q/k/v weight's parts)."""
        if not (0 <= start < end <= self.num_out) or start % 32 or end % 32:
            raise ValueError(
                f"columns [{start}, {end}) must be multiples of 32 within [0, {self.num_out}]"
            )
        if (start, end) == (0, self.num_out):
            return self
        per_column = self.num_in  # packed elements per output column
        return PackedLinear(
            self.packed[start * per_column : end * per_column],
            end - start,
            self.num_in,
            None if self.bias is None else self.bias[start:end],
        )


_lock = threading.Lock()
_loaded: dict[tuple[Path, str, int], RowsAttention | KernelUnavailable] = {}


def load_rows_attention(
    cache_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    head_dim: int = HEAD_DIM,
) -> RowsAttention:
    """The compiled kernel for ``dtype`` (bfloat16: AMX, else AVX512-BF16; float32: AVX2) and
    ``head_dim``, or the build ``name``, built once per source/flags/compiler into
    ``cache_dir``/kernels, or ``KernelUnavailable`` with the reason. Builds are tried most preferred
    first, so an AMX build that fails its self-check leaves AVX512-BF16 (``select_rows_attention``
    also says why). Thread-safe; cached per process."""
    return select_rows_attention(cache_dir, dtype, name, head_dim)[0]


def select_rows_attention(
    cache_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    head_dim: int = HEAD_DIM,
) -> tuple[RowsAttention, KernelUnavailable | None]:
    """As ``load_rows_attention``, and why a more preferred build was passed over: the first such
    build's ``KernelUnavailable`` when it is a defect (it failed to build or its self-check), else
    None (the kernel is this CPU's best, or the better builds need features this CPU lacks)."""
    specs = kernels_for(dtype)
    if name is not None:
        specs = tuple(spec for spec in specs if spec.name == name)
    if not specs:
        which = f"the {name} kernel does not run" if name else "no native kernel runs"
        raise KernelUnavailable(
            f"{which} {dtype_name(dtype)} (amx and avx512bf16 run bfloat16, avx2 float32)", "shape"
        )
    if head_dim not in HEAD_DIMS:
        raise KernelUnavailable(
            f"it handles head_dim {' or '.join(map(str, HEAD_DIMS))} only (this model: {head_dim})",
            "shape",
        )
    first_error = passed_over = None
    for spec in specs:
        try:
            return _load_cached(spec, Path(cache_dir), head_dim), passed_over
        except KernelUnavailable as e:
            first_error = first_error or e
            if passed_over is None and e.is_defect:
                passed_over = e
    # the first broken build's reason, else the most preferred build's (a CPU without AMX must not
    # hide a broken AVX512-BF16 build behind "this CPU lacks amx_tile")
    raise passed_over or first_error


def _load_cached(spec: KernelSpec, cache_dir: Path, head_dim: int = HEAD_DIM) -> RowsAttention:
    with _lock:
        key = (cache_dir, spec.name, head_dim)
        if key not in _loaded:
            try:
                _loaded[key] = _build_and_load(spec, cache_dir / "kernels", head_dim)
            except KernelUnavailable as e:
                _loaded[key] = e
        result = _loaded[key]
    if isinstance(result, KernelUnavailable):
        raise result
    return result


def build_flags(spec: KernelSpec, head_dim: int = HEAD_DIM) -> tuple[str, ...]:
    """The compiler flags of ``spec`` for ``head_dim`` (the 64 build's are the spec's own)."""
    return spec.cflags if head_dim == HEAD_DIM else (*spec.cflags, f"-DKVB_HEAD_DIM={head_dim}")


_compiler_versions: dict[str, str] = {}


def compiler_version(cc: str) -> str:
    """The first line of ``cc --version`` ("gcc (Debian 12.2.0-14) 12.2.0"): builds and
    their failure records are keyed by it, so a fixed or upgraded compiler at the same
    path builds afresh."""
    if cc not in _compiler_versions:
        try:
            proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
            lines = proc.stdout.strip().splitlines()
            _compiler_versions[cc] = lines[0] if proc.returncode == 0 and lines else "unknown"
        except (OSError, subprocess.TimeoutExpired):
            _compiler_versions[cc] = "unknown"
    return _compiler_versions[cc]


def _build_and_load(spec: KernelSpec, out_dir: Path, head_dim: int = HEAD_DIM) -> RowsAttention:
    flags = cpu_flags()
    missing = [f for f in spec.cpu_flags if f not in flags]
    if missing:
        raise KernelUnavailable(
            f"this CPU lacks {', '.join(missing)} (needed by the {spec.name} kernel)", "cpu"
        )
    cc = shutil.which(env.read("CC")) or shutil.which("cc")
    if cc is None:
        raise KernelUnavailable(
            f"no C compiler (gcc) on PATH to build the {spec.name} kernel", "compiler"
        )
    path = build_path(spec, out_dir, head_dim, cc)
    failed = path.with_suffix(".failed")  # a build that failed its self-check is not retried
    if failed.is_file():
        raise KernelUnavailable(failed.read_text().strip(), "selfcheck")
    if not path.is_file():
        _build_checked(spec, cc, Path(__file__).with_name(spec.source), path, failed, head_dim)
    return open_library(path, spec, head_dim)


def build_path(spec: KernelSpec, out_dir: Path, head_dim: int, cc: str) -> Path:
    """Where the build of ``spec`` for ``head_dim`` by compiler ``cc`` lives (its failure
    record beside it, ``.failed``): keyed by the source and the headers it includes, the
    flags, the compiler's path and its version, so an edited source or another compiler builds
    (and checks) afresh."""
    source_path = Path(__file__).with_name(spec.source)
    headers = sorted(source_path.parent.glob("*.h"))  # what it includes is part of what is built
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in headers)
    key = b"\0".join(
        [
            source,
            " ".join(build_flags(spec, head_dim)).encode(),
            cc.encode(),
            compiler_version(cc).encode(),
        ]
    )
    return out_dir / f"{spec.name}-d{head_dim}-{hashlib.sha256(key).hexdigest()[:16]}.so"


def _build_checked(
    spec: KernelSpec, cc: str, source_path: Path, path: Path, failed: Path, head_dim: int = HEAD_DIM
) -> None:
    """Compile into a temp file, self-check it in a subprocess, then move it into place atomically
    (concurrent builders race harmlessly). A failed self-check is recorded in ``failed``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *build_flags(spec, head_dim), str(source_path), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise KernelUnavailable(
                f"building the {spec.name} kernel (head_dim {head_dim}) with "
                f"{compiler_version(cc)} failed: {proc.stderr.strip()[-500:]}",
                "build",
            )
        problem, about_the_build = _self_check(tmp, spec, head_dim)
        if problem is not None:
            reason = (
                f"the {spec.name} kernel (head_dim {head_dim}) built by {cc} "
                f"({compiler_version(cc)}) failed its self-check: {problem}"
            )
            if (
                about_the_build
            ):  # a crash or wrong numbers: not retried; anything else is, next process
                failed.write_text(reason + "\n")
            raise KernelUnavailable(reason, "selfcheck")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _self_check(
    lib_path: str, spec: KernelSpec, head_dim: int = HEAD_DIM
) -> tuple[str | None, bool]:
    """Run kvblend.kernels.selfcheck on a new build in a subprocess: a miscompiled kernel may crash,
    and that must not take this process down. Returns (None, False) when it passed, else (what went
    wrong, whether that is the build's fault: it crashed or gave wrong numbers)."""
    package_root = str(
        Path(__file__).resolve().parents[2]
    )  # importable even when not pip-installed
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvblend.kernels.selfcheck", lib_path, spec.name, str(head_dim)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env.child_environ(prepend_path=package_root),
        )
    except subprocess.TimeoutExpired:
        return "it did not finish within 300 s", False
    if proc.returncode == 0:
        return None, False
    if proc.returncode < 0:
        return f"it crashed ({signal.Signals(-proc.returncode).name})", True
    last_line = (
        proc.stderr.strip().splitlines()[-1]
        if proc.stderr.strip()
        else f"exit status {proc.returncode}"
    )
    return last_line, proc.returncode == EXIT_MISMATCH


def open_library(path: Path, spec: KernelSpec, head_dim: int = HEAD_DIM) -> RowsAttention:
    """Load a built kernel (compiled for ``head_dim``) and set up its CPU state (AMX asks the
    OS for tile state)."""
    lib = ctypes.CDLL(str(path))
    _declare(lib, spec.init_symbol)
    if spec.init_symbol is not None and getattr(lib, spec.init_symbol)() != 0:
        raise KernelUnavailable(
            f"the OS refused the {spec.name} kernel's CPU state to this process (arch_prctl)", "os"
        )
    return RowsAttention(lib, Path(path), spec, head_dim)


def _declare(lib: ctypes.CDLL, init_symbol: str | None) -> None:
    P, L, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    if init_symbol is not None:
        init = getattr(lib, init_symbol)
        init.restype = I
        init.argtypes = []
    lib.kvb_rows_attention_scratch_bytes.restype = L
    lib.kvb_rows_attention_scratch_bytes.argtypes = [L, I]
    if hasattr(lib, "kvb_rms_norm"):  # the bf16 builds' row-wise ops (rows_elementwise.h)
        lib.kvb_rms_norm.restype = I
        lib.kvb_rms_norm.argtypes = [P, L, P, L, P, L, P, ctypes.c_float, P, L, L, L, I]
        lib.kvb_silu_mul.restype = I
        lib.kvb_silu_mul.argtypes = [P, L, P, L, L, L, I]
        lib.kvb_scatter_rows.restype = I
        lib.kvb_scatter_rows.argtypes = [P, L, L, P, L, I, L, P, L, L]
    if hasattr(lib, "kvb_decode_attention"):  # the bf16 builds' decoding step (decode_attention.h)
        lib.kvb_decode_attention.restype = I
        lib.kvb_decode_attention.argtypes = [P, L, P, L, P, L, L, I, I, I, ctypes.c_float, P, I]
    if hasattr(lib, "kvb_gemv"):  # the bf16 builds' few-row projections (gemv.h)
        lib.kvb_gemv.restype = I
        lib.kvb_gemv.argtypes = [P, L, L, L, P, L, L, P, P, L, P, L, I]
        lib.kvb_gemv_max_rows.restype = L
        lib.kvb_gemv_max_rows.argtypes = []
    if hasattr(lib, "kvb_linear"):  # the AMX build's projections (amx_linear.h)
        lib.kvb_linear_pack.restype = I
        lib.kvb_linear_pack.argtypes = [P, L, L, P]
        lib.kvb_linear.restype = I
        lib.kvb_linear.argtypes = [P, L, L, L, P, L, P, P, L, P, L, I]
    attention_args = [P, L, P, L, P, L, P, L, P, P, P, L, L, I, I, I, ctypes.c_float, P, L, P, L, I]
    lib.kvb_rows_attention.restype = I
    lib.kvb_rows_attention.argtypes = attention_args
    if hasattr(
        lib, "kvb_rows_attention_mass"
    ):  # the bf16 builds: also the attention each key receives
        lib.kvb_rows_attention_mass.restype = I
        lib.kvb_rows_attention_mass.argtypes = [*attention_args, P]
