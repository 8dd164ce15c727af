"""Layer-level operations over a transformers Llama/Mistral/Qwen2/Qwen3 model.

kvblend drives the layer loop itself (which rows compute at which layer, where KV comes from), but
every weight and module is the HF model's own, so `full` prefill matches transformers exactly and
RoPE variants (`rope_scaling`: llama3, yarn, linear, dynamic) come from the model's rotary module.
Shapes: hidden rows h [A, D]; per-head tensors [heads, A, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TransformerOps:
    def __init__(self, hf_model: torch.nn.Module):
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
        self.scaling = self.head_dim ** -0.5
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")  # Qwen3
        self.dtype = self.embed_tokens.weight.dtype
        self.device = self.embed_tokens.weight.device
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", 4096))

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] for absolute ``positions`` [N], via the model's own rotary module."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, positions.view(1, -1).to(self.device))
        return cos[0], sin[0]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device))  # [A, D]

    def qkv(self, layer_idx: int, h: torch.Tensor):
        """Pre-RoPE q [Hq, A, d], k [Hkv, A, d] and v [Hkv, A, d] of rows ``h`` [A, D]."""
        layer = self.layers[layer_idx]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        n = x.shape[0]
        q = attn.q_proj(x).view(n, -1, self.head_dim)
        k = attn.k_proj(x).view(n, -1, self.head_dim)
        v = attn.v_proj(x).view(n, -1, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = True) -> torch.Tensor:
        """q [Hq, S, d] over k, v [Hkv, T, d]. mask: bool [S, T] (True = may attend); None with
        ``causal`` for plain causal attention (S == T), None without it to see every key (decode).
        Returns [S, Hq * d]."""
        if mask is None:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal,
                                                 scale=self.scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)

    def attend_block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block) -> torch.Tensor:
        """q [Hq, S, d] of one row block over k, v [Hkv, num_keys, d] -> [S, Hq * d].

        On CPU the unmasked head [0, split) and the tail run as two flash-attention calls merged by
        their log-sum-exp: a masked kernel is several times slower per score than a plain or causal one.
        For the head (and a scattered tail) query heads sharing a KV head are stacked as rows, so K/V
        are not repeated in memory; a contiguous tail is square and runs the causal kernel."""
        if q.device.type != "cpu":
            return self.attend(q, k, v, block.mask)
        num_rows, rep, d = q.shape[1], self.num_heads // self.num_kv_heads, self.head_dim
        if block.contiguous and block.split <= num_rows:
            # A run after a short stored head (prefix mode, blend@1): pad the queries with the head's
            # positions and run one causal kernel; the padded rows cost less than a merge would.
            padded = torch.cat([q.new_zeros(q.shape[0], block.split, d), q], dim=1)
            return self.attend(padded, k, v, None)[block.split:]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        qg = q.reshape(self.num_kv_heads, rep * num_rows, d)[None]  # [1, Hkv, rep*S, d]
        k_tail, v_tail = k[None, :, block.split:], v[None, :, block.split:]
        if block.contiguous:
            out, lse = flash(q[None], k_tail.repeat_interleave(rep, 1), v_tail.repeat_interleave(rep, 1),
                             0.0, True, scale=self.scaling)  # [1, Hq, S, d], [1, Hq, S]
            out, lse = out.reshape(qg.shape), lse.reshape(qg.shape[:3])
        else:
            out, lse = flash(qg, k_tail, v_tail, 0.0, False, attn_mask=block.float_tail_mask(rep, q.dtype),
                             scale=self.scaling)
        if block.split > 0:
            head_out, head_lse = flash(qg, k[None, :, :block.split], v[None, :, :block.split], 0.0, False,
                                       scale=self.scaling)
            # softmax over both key ranges = the two partial results weighted by their mass
            w_head = torch.sigmoid(head_lse - lse)[..., None]
            out = torch.lerp(out.float(), head_out.float(), w_head).to(q.dtype)
        # [1, Hkv, rep*S, d] -> [Hq, S, d] -> [S, Hq*d]
        return out[0].reshape(self.num_heads, num_rows, d).transpose(0, 1).reshape(num_rows, -1)

    def finish_layer(self, layer_idx: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then residual + MLP. h, attn_out: [S, D] / [S, Hq*d] -> [S, D]."""
        layer = self.layers[layer_idx]
        h = h + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[S, D] -> float32 logits [S, vocab]."""
        return self.lm_head(self.final_norm(h)).float()
