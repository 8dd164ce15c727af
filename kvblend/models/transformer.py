"""Layer-level operations over a transformers Llama/Mistral/Qwen2/Qwen3 model.

kvblend drives the layer loop itself (which rows compute at which layer, where KV comes from), but
every weight and module is the HF model's own, so `full` prefill matches transformers exactly and
RoPE variants (`rope_scaling`: llama3, yarn, linear, dynamic) come from the model's rotary module.
Shapes: hidden rows h [A, D]; per-head tensors [heads, A, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_QKV_PARTS = ("qkv", "qk", "kv", "q", "k", "v")


class TransformerOps:
    def __init__(self, hf_model: torch.nn.Module, rows_attention=None):
        hf_model.requires_grad_(False)  # inference only: no autograd graph behind any activation
        inner = hf_model.model
        cfg = hf_model.config
        self.config = cfg
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.rotary = inner.rotary_emb
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")  # Qwen3
        self.dtype = self.embed_tokens.weight.dtype
        self.device = self.embed_tokens.weight.device
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", 4096))
        # One matmul for q/k/v and one for gate/up per layer instead of three and two: a blend
        # recomputes ~15% of rows, and at that size per-call overhead is a large share of a matmul.
        self.qkv_proj = [
            _fuse_linears([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj])
            for l in self.layers
        ]
        self.qkv_split = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        self.fused_mlp = getattr(cfg, "hidden_act", None) == "silu" and all(
            hasattr(l.mlp, "gate_proj") and hasattr(l.mlp, "up_proj") for l in self.layers
        )
        self.gate_up_proj = (
            [_fuse_linears([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
            if self.fused_mlp
            else []
        )
        # kvblend.kernels.RowsAttention (native attention with RoPE fused: AMX bf16
        # / AVX2 fp32) or None.
        self.rows_attention = rows_attention
        self._rope_half: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope_half_tables
        # (layer, "qkv" | "o" | "down") -> the kernel's packed weight, or None where it
        # does not take the shape
        self._packed: dict[tuple[int, str], object] = {}

    def rope_half_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 (cos, sin) [num_positions, head_dim / 2] from the model's rotary module, or None
        when its tables do not repeat their first half (the form the native kernel rotates with).
        Kept for the longest prompt so far and sliced (~8 ms a 6k-token prompt otherwise), except
        for "dynamic" RoPE, whose frequencies depend on the length asked for."""
        cached = self._rope_half
        if cached is not None and cached[0].shape[0] >= num_positions:
            return cached[0][:num_positions], cached[1][:num_positions]
        tables = self._compute_rope_half_tables(num_positions)
        if tables is not None and "dynamic" not in str(getattr(self.rotary, "rope_type", "")):
            self._rope_half = tables
        return tables

    def _compute_rope_half_tables(
        self, num_positions: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        cos, sin = self.rotary(probe, torch.arange(num_positions, device=self.device).view(1, -1))
        cos, sin = cos[0].float(), sin[0].float()
        half = self.head_dim // 2
        if not (
            torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
        ):
            return None
        return cos[:, :half].contiguous(), sin[:, :half].contiguous()

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] for absolute ``positions`` [N], via the model's
        own rotary module."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, positions.view(1, -1).to(self.device))
        return cos[0], sin[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device))  # [A, D]

    def qkv(self, layer_idx: int, h: torch.Tensor, parts: str = "qkv"):
        """Pre-RoPE projections of rows ``h`` [A, D]: q [Hq, A, d], k [Hkv, A, d], v
        [Hkv, A, d], one per letter of ``parts`` ("qkv", "qk", "kv", "q", "k" or "v": rows of
        the fused weight in that order, so a part is one matmul over a slice of it; a blend
        needs only some parts for some rows)."""
        if parts not in _QKV_PARTS:
            raise ValueError(f"parts must be one of {_QKV_PARTS}, got {parts!r}")
        layer = self.layers[layer_idx]
        attn = layer.self_attn
        x, _ = self._norm(layer.input_layernorm, h)
        n = x.shape[0]
        first, last = "qkv".index(parts[0]), "qkv".index(parts[-1]) + 1
        bounds = [0, self.qkv_split[0], self.qkv_split[0] + self.qkv_split[1], sum(self.qkv_split)]
        weight, bias = self.qkv_proj[layer_idx]
        packed = self._packed_weight(layer_idx, "qkv", weight, bias, x)
        if (
            packed is not None and bounds[first] % 32 == 0 and bounds[last] % 32 == 0
        ):  # [A, sum of the parts' widths]
            out = self.rows_attention.linear(
                x, packed.columns(bounds[first], bounds[last]), torch.get_num_threads()
            )
        else:
            rows = slice(bounds[first], bounds[last])
            out = self._linear(x, weight[rows], None if bias is None else bias[rows])
        tensors = out.split(self.qkv_split[first:last], dim=-1)
        tensors = {p: t.view(n, -1, self.head_dim) for p, t in zip(parts, tensors)}
        if self.has_qk_norm:
            if "q" in tensors:
                tensors["q"] = attn.q_norm(tensors["q"])
            if "k" in tensors:
                tensors["k"] = attn.k_norm(tensors["k"])
        return tuple(tensors[p].transpose(0, 1) for p in parts)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = True,
    ) -> torch.Tensor:
        """q [Hq, S, d] over k, v [Hkv, T, d]. mask: bool [S, T] (True = may attend); None with
        ``causal`` for plain causal attention (S == T), None without it to see every key (decode).
        Returns [S, Hq * d]."""
        if mask is None:
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=causal, scale=self.scaling, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=self.scaling, enable_gqa=True
            )
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)

    def decode_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One decoding row: q [Hq, d] over every key of k, v [Hkv, n, d] (q and k rotated) ->
        [1, Hq * d]. The native kernel reads the cache in place where it takes the tensors (a bf16
        build of this head size, dense rows), else SDPA."""
        kernel, d = self.rows_attention, self.head_dim
        dense = q.stride(-1) == 1 and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (k, v))
        if (
            kernel is not None
            and kernel.has_decode
            and q.dtype == kernel.dtype
            and q.device.type == "cpu"
            and kernel.head_dim == d
            and dense
        ):
            return kernel.decode_attention(q, k, v, self.scaling, torch.get_num_threads())
        return self.attend(q[:, None], k, v, mask=None, causal=False)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def attend_rows(
        self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks
    ) -> torch.Tensor:
        """Attention of a sorted set of rows, block by block (``blocks``:
        RowBlocks over those rows).

        qg [Hkv, A * rep, d]: post-RoPE queries grouped by KV head, a row's ``rep`` query heads
        adjacent, so a block of rows is a contiguous slice and K/V are never repeated in memory.
        k, v [Hkv, num_keys, d] (post-RoPE keys of every position). Returns [A, Hq * d].
        """
        rep, d = self.group_size, self.head_dim
        num_rows = qg.shape[1] // rep
        out = torch.empty(num_rows, self.num_kv_heads, rep, d, dtype=qg.dtype, device=qg.device)
        grouped_out = out.permute(1, 0, 2, 3)  # [Hkv, A, rep, d] view: blocks write in place
        for blk in blocks:
            lo, hi = blk.rows.start, blk.rows.stop
            qb = qg[:, lo * rep : hi * rep]  # [Hkv, n * rep, d]
            if qg.device.type != "cpu":
                res = self.attend(
                    _heads_major(qb, rep), k[:, : blk.num_keys], v[:, : blk.num_keys], blk.mask
                )
                out[lo:hi] = res.view(hi - lo, self.num_kv_heads, rep, d)
            else:
                self._attend_block_cpu(qb, k, v, blk, grouped_out[:, lo:hi])
        return out.view(num_rows, -1)

    def _attend_block_cpu(
        self, qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk, dst: torch.Tensor
    ) -> None:
        """One block into dst [Hkv, n, rep, d]. Keys [0, split) precede every row: one unmasked
        flash call; the tail [split, num_keys) runs masked (or causal when the rows are
        consecutive); the two partial results merge by their log-sum-exp. A masked kernel is slower
        per score, hence the split."""
        rep, d = self.group_size, self.head_dim
        n = qb.shape[1] // rep
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        k_tail, v_tail = k[None, :, blk.split : blk.num_keys], v[None, :, blk.split : blk.num_keys]
        if blk.contiguous:
            qh = _heads_major(qb, rep)  # causal masks need one query head per row
            if blk.split <= n:
                # A run after a short stored head (prefix mode, blend@1): pad the queries with the
                # head's positions and run one causal kernel; the padded rows
                # cost less than a merge.
                padded = torch.cat([qh.new_zeros(qh.shape[0], blk.split, d), qh], dim=1)
                res = self.attend(padded, k[:, : blk.num_keys], v[:, : blk.num_keys], None)[
                    blk.split :
                ]
                dst.copy_(res.view(n, self.num_kv_heads, rep, d).transpose(0, 1))
                return
            tail_out, tail_lse = flash(
                qh[None],
                k_tail.repeat_interleave(rep, 1),
                v_tail.repeat_interleave(rep, 1),
                0.0,
                True,
                scale=self.scaling,
            )  # [1, Hq, n, d], [1, Hq, n]
            tail_out = (
                tail_out[0].view(self.num_kv_heads, rep, n, d).transpose(1, 2)
            )  # [Hkv, n, rep, d]
            tail_lse = tail_lse[0].view(self.num_kv_heads, rep, n).transpose(1, 2)
        else:
            tail_out, tail_lse = flash(
                qb[None],
                k_tail,
                v_tail,
                0.0,
                False,
                scale=self.scaling,
                attn_mask=blk.float_tail_mask(rep, qb.dtype),
            )
            tail_out = tail_out[0].view(self.num_kv_heads, n, rep, d)
            tail_lse = tail_lse[0].view(self.num_kv_heads, n, rep)
        if blk.split == 0:
            dst.copy_(tail_out)
            return
        head_out, head_lse = flash(
            qb[None],
            k[None, :, : blk.split],
            v[None, :, : blk.split],
            0.0,
            False,
            scale=self.scaling,
        )
        # softmax over both key ranges = the two partial results weighted by their mass
        weight = torch.sigmoid(head_lse[0].view(self.num_kv_heads, n, rep) - tail_lse).unsqueeze(-1)
        torch.lerp(
            tail_out, head_out[0].view(self.num_kv_heads, n, rep, d), weight.to(qb.dtype), out=dst
        )

    def finish_layer(self, layer_idx: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then residual + MLP. h, attn_out: [S, D] / [S, Hq*d] -> [S, D].
        A long prompt's MLP runs in even row blocks (``mlp_row_blocks``): rows are
        independent there."""
        layer = self.layers[layer_idx]
        attn_proj = self._project(layer_idx, "o", layer.self_attn.o_proj, attn_out)
        x, h = self._norm(layer.post_attention_layernorm, h, attn_proj)  # x: the MLP's normed input
        blocks = (
            mlp_row_blocks(h.shape[0], h.dtype)
            if h.device.type == "cpu"
            else [slice(0, h.shape[0])]
        )
        if len(blocks) == 1:
            return self._mlp(layer_idx, x, h)
        out = torch.empty_like(h)
        for rows in blocks:
            self._mlp(layer_idx, x[rows], h[rows], out[rows])
        return out

    def _mlp(
        self,
        layer_idx: int,
        x: torch.Tensor,
        residual: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + the MLP's output, for normed rows x [S, D] (residual [S, D]); into
        ``out`` when given."""
        layer = self.layers[layer_idx]
        if not self.fused_mlp:
            return torch.add(residual, layer.mlp(x), out=out)
        weight, bias = self.gate_up_proj[layer_idx]
        packed = self._packed_weight(layer_idx, "gate_up", weight, bias, x)
        if packed is None:
            gate_up = self._linear(x, weight, bias)  # [S, 2 * intermediate]
        else:
            gate_up = self.rows_attention.linear(x, packed, torch.get_num_threads())
        if self._native_elementwise(gate_up) and gate_up.shape[1] % 32 == 0:
            act = self.rows_attention.silu_mul(gate_up, torch.get_num_threads())
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        return self._project(layer_idx, "down", layer.mlp.down_proj, act, residual, out)

    def write_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        """dst[:, rows] = src for a layer's K or V: dst [Hkv, T, d], src [Hkv, A, d], rows [A]
        (sorted, distinct). A plain copy when the rows are all of them; the native scatter for a
        bf16 model on the CPU (one memcpy a row and head); else index_copy_ (a little faster than
        index_put for ~1k rows)."""
        if rows.numel() == dst.shape[1]:
            dst.copy_(src)
        elif (
            self._native_elementwise(src[0])
            and dst.device.type == "cpu"
            and dst.stride(-1) == 1
            and dst.stride(1) == dst.shape[2]
        ):
            self.rows_attention.scatter_rows(dst, src, rows.contiguous())
        else:
            dst.index_copy_(1, rows, src)

    def _native_elementwise(self, x: torch.Tensor) -> bool:
        """Whether rows x [S, W] go through the native row-wise ops (a bf16 build of the
        kernels, on the CPU)."""
        kernel = self.rows_attention
        return (
            kernel is not None
            and kernel.has_elementwise
            and x.dtype == kernel.dtype
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.stride(-1) == 1
            and x.shape[-1] % 16 == 0
        )

    def _norm(self, norm: torch.nn.Module, h: torch.Tensor, delta: torch.Tensor | None = None):
        """(norm(h'), h') for rows h [S, D], where h' = h + delta (the residual add before a norm)
        or h. HF RMSNorms of a bf16 model go through the native kernel in one pass
        (rows_elementwise.h); anything else through ``_rms_norm``."""
        if (
            _is_hf_rms(norm)
            and self._native_elementwise(h)
            and (delta is None or self._native_elementwise(delta))
        ):
            out, total = self.rows_attention.rms_norm(
                h, norm.weight, norm.variance_epsilon, torch.get_num_threads(), delta
            )
            return out, h if total is None else total
        if delta is not None:
            h = h + delta
        return _rms_norm(norm, h), h

    def _project(
        self,
        layer_idx: int,
        name: str,
        module: torch.nn.Linear,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """module(x) (+ residual) for x [S, in]; through the native AMX projection for the row
        counts a blend recomputes (NATIVE_LINEAR_MAX_ROWS), where oneDNN's two-thread split is poor,
        with the residual add in its epilogue. ``out``: where the result goes, else a new tensor."""
        packed = self._packed_weight(layer_idx, name, module.weight, module.bias, x, residual, out)
        if packed is not None:
            return self.rows_attention.linear(x, packed, torch.get_num_threads(), residual, out)
        return self._linear(x, module.weight, module.bias, residual, out)

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [S, in] @ weight [out, in]^T (+ bias) (+ residual, added after the product's
        rounding), into ``out`` when given: the native few-row projection where it is faster
        (``_gemv_takes``), else PyTorch's."""
        if self._gemv_takes(x, weight, residual, out):
            return self.rows_attention.gemv(x, weight, bias, torch.get_num_threads(), residual, out)
        y = F.linear(x, weight, bias)
        if residual is not None:
            return torch.add(residual, y, out=out)
        return y if out is None else out.copy_(y)

    def _gemv_takes(
        self, x: torch.Tensor, weight: torch.Tensor, *more: torch.Tensor | None
    ) -> bool:
        """Whether x [S, in] @ weight^T goes through the native few-row projection (gemv.h): a
        bf16 build on the CPU, at most GEMV_MAX_ROWS rows, a weight of at least GEMV_MIN_WEIGHT
        elements (below, PyTorch's call is cheaper than the kernel's hand-off), dense rows."""
        kernel = self.rows_attention
        return (
            kernel is not None
            and kernel.has_gemv
            and x.shape[0] <= GEMV_MAX_ROWS
            and weight.numel() >= GEMV_MIN_WEIGHT
            and x.dtype == weight.dtype == kernel.dtype
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.stride(-1) == 1
            and weight.stride(-1) == 1
            and all(t is None or t.stride(-1) == 1 for t in more)
        )

    def _packed_weight(
        self,
        layer_idx: int,
        name: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        *more: torch.Tensor | None,
    ):
        """The native projection's packed ``weight`` ("qkv", "o", "gate_up" or "down") for rows x
        [S, in] (and the call's other row tensors ``more``), packed at first use, a copy beside the
        module's (SmolLM2-135M: 212 MB for all four); None where the call goes to PyTorch: no AMX
        build, more rows than NATIVE_LINEAR_MAX_ROWS[name], another dtype or device, rows that are
        not dense, a shape it does not take."""
        kernel = self.rows_attention
        if (
            kernel is None
            or not kernel.has_linear
            or x.shape[0] > NATIVE_LINEAR_MAX_ROWS[name]
            or x.dtype != kernel.dtype
            or x.device.type != "cpu"
            or x.stride(-1) != 1
            or any(t is not None and t.stride(-1) != 1 for t in more)
        ):
            return None
        key = (layer_idx, name)
        if key not in self._packed:
            self._packed[key] = kernel.pack_linear(weight, bias)
        return self._packed[key]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[S, D] -> float32 logits [S, vocab]."""
        x = self._norm(self.final_norm, h)[0]
        if isinstance(self.lm_head, torch.nn.Linear):
            return self._linear(x, self.lm_head.weight, self.lm_head.bias).float()
        return self.lm_head(x).float()


# Most rows each projection takes through the native AMX kernel (kvblend/kernels/amx_linear.h),
# above which oneDNN's. Measured on a 2-core Sapphire Rapids, bf16, SmolLM2 shapes. o_proj and
# down_proj, median of 25 calls, at 960 rows: 0.37 ms against oneDNN's 0.60, 0.84 against 1.77; at
# 3,104 rows oneDNN wins (0.95 / 2.72 ms against 1.26 / 2.82). q/k/v and gate/up alone are faster on
# oneDNN (960 rows: 0.47 / 1.14 ms against the kernel's 0.60 / 1.75), but between the native norm
# and attention a oneDNN call first wakes PyTorch's OpenMP threads: one row's norm + q/k/v took 0.36
# ms against 0.07 for the matmul alone. In place, a layer's q/k/v + o_proj + MLP was faster with the
# kernel's q/k/v up to 1,280 rows (5.49 against 5.77 ms), about even at 1,536 (6.33 against 6.24)
# and slower at 2,048 (8.01 against 7.83); o_proj + MLP with the kernel's gate/up up to 512 rows
# (2.15 against 2.21 ms; 1 row 0.32 against 0.62) and slower at 960 (3.65 against 3.27).
NATIVE_LINEAR_MAX_ROWS = {"qkv": 1280, "o": 2048, "gate_up": 512, "down": 2048}

# Where the native few-row projection (kvblend/kernels/gemv.h) replaces PyTorch's bf16 matmul:
# decoding one or two sequences, and a prefill's last row. It streams a weight faster than
# PyTorch's call for one row but gains little at 4 rows and loses from 8; below ~1M weight
# elements PyTorch's call is cheaper than the kernel's hand-off (docs/benchmarks.md, "Decoding").
GEMV_MAX_ROWS = 2
GEMV_MIN_WEIGHT = 1 << 20

# Most rows one MLP call takes on the CPU, by dtype. Measured on a 2-core Sapphire Rapids (SmolLM2
# shapes, D 576 -> 2 x 1536): bf16 gate/up cost 1.35 us/row at 5,120 rows and 3.44 at 6,256 (its
# [S, 3072] output no longer stays in cache), so a 6,256-row MLP took 36 ms whole and 21 ms as two
# blocks; fp32 132 ms whole, 117 ms in blocks of <= 2,048 rows (blocks of 4,096 rows did not help
# fp32 at 4-7.5k rows).
MLP_MAX_ROWS = {torch.bfloat16: 4096, torch.float32: 2048}


def mlp_row_blocks(num_rows: int, dtype: torch.dtype) -> list[slice]:
    """Even row blocks of at most MLP_MAX_ROWS[dtype] rows, each a multiple of 16 rows but the last
    (so oneDNN reuses its matmul primitives across layers); one block when the rows fit."""
    max_rows = MLP_MAX_ROWS.get(dtype, num_rows)
    if num_rows <= max_rows:
        return [slice(0, num_rows)]
    num_blocks = -(-num_rows // max_rows)
    step = -(-num_rows // num_blocks // 16) * 16
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def _heads_major(qg: torch.Tensor, rep: int) -> torch.Tensor:
    """[Hkv, n * rep, d] grouped queries -> [Hq, n, d] (query head h = kv head h // rep,
    as HF's repeat_kv)."""
    num_kv_heads, rows, d = qg.shape
    return (
        qg.view(num_kv_heads, rows // rep, rep, d)
        .transpose(1, 2)
        .reshape(num_kv_heads * rep, rows // rep, d)
    )


def _fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight [sum(out), in], bias or None) for linears sharing an input. The modules' own
    parameters are re-pointed at slices of it, so the model keeps working and
    memory is not doubled."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat(
            [
                lin.bias.detach()
                if lin.bias is not None
                else lin.weight.new_zeros(lin.out_features)
                for lin in linears
            ]
        )
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = torch.nn.Parameter(weight[row : row + n], requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


def _rms_norm(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm, h * rsqrt(mean(h^2) + eps) * weight, in two passes over h [S, D]: one
    fp32 reduction (vector_norm) and one scaling (HF's module makes five, F.rms_norm on CPU four).
    In bf16 the per-row scale is rounded once more than HF's (within an ulp); in fp32 it is HF's
    math. Modules of another kind run as they are."""
    if not _is_hf_rms(norm):
        return norm(h)
    eps, weight = norm.variance_epsilon, norm.weight
    sq_norm = torch.linalg.vector_norm(
        h, 2, dim=-1, keepdim=True, dtype=torch.float32
    ).square_()  # [S, 1]
    scale = sq_norm.div_(h.shape[-1]).add_(eps).rsqrt_()
    return torch.mul(h, scale.to(h.dtype)).mul_(weight)


def _is_hf_rms(norm: torch.nn.Module) -> bool:
    """An HF RMSNorm with the plain math (x * rsqrt(mean(x^2) + eps) * weight), whose forward is the
    class's own (not patched)."""
    return (
        getattr(norm, "variance_epsilon", None) is not None
        and getattr(norm, "weight", None) is not None
        and type(norm).forward is _HF_RMS_FORWARDS.get(type(norm).__name__, None)
    )


def _hf_rms_forwards() -> dict:
    """forward functions of the HF RMSNorm classes whose math F.rms_norm reproduces
    (x * rsqrt(mean(x^2) + eps) * weight, in fp32, no offset on the weight)."""
    found = {}
    for module, name in [
        ("llama", "LlamaRMSNorm"),
        ("mistral", "MistralRMSNorm"),
        ("qwen2", "Qwen2RMSNorm"),
        ("qwen3", "Qwen3RMSNorm"),
    ]:
        try:
            mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[name])
            found[name] = getattr(mod, name).forward
        except (ImportError, AttributeError):
            continue
    return found


_HF_RMS_FORWARDS = _hf_rms_forwards()
