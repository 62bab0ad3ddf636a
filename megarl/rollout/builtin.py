"""The built-in rollout engine: Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3 decoding in plain PyTorch.

It lets megarl run, and be tested, with nothing but torch installed (CPU included); SGLang fits behind the same
protocol for scale. It implements `RolloutEngine` for decoder-only models with RMSNorm, a SwiGLU MLP, default
RoPE and grouped-query attention (Qwen2 adds q/k/v biases; Qwen3 an RMSNorm over each query and key head; Qwen3-MoE
a router that sends each token to its top-k SwiGLU experts, `_moe`; DeepSeek-V3 multi-latent attention, its
router and a shared expert, from `megarl/models/deepseek_v3/engine.py`). It knows nothing of Megatron: weights arrive
only as Hugging Face-named tensors, through `update_weights` or a sync's buckets (`load_weight_buckets`).

How one `generate` call runs:
  * all prompts x n samples decode as ONE batch. Prompts are left-padded, so every row writes its next key/value
    into the same KV-cache column; padding is hidden by an additive key mask and positions count real tokens only.
  * each distinct prompt is prefilled once and its KV cache copied to its n sample rows.
  * the KV cache is preallocated per call (`KVCache`); keys are stored transposed so that decode attention is two
    plain batched matmuls, which on CPU beat SDPA's kernel for one query per head by about 2x.
  * decoding goes step by step; a row ends on one of `stop_token_ids`, on a token that completes one of the `stop`
    strings in the text of its new tokens (`StopStrings`: the tokenizer decodes only a short tail per step), or at
    `max_new_tokens`; once a quarter of the batch has ended, ended rows are dropped (the batch is compacted) so
    they cost no more compute.
  * log-probs are log_softmax(logits / temperature) at the chosen token, before top-k / top-p truncation,
    i.e. what the actor recomputes (see `Completion`).

Small models pay per-op dispatch on every step, so the layout is fused where HF names allow it: q/k/v are one
matmul, gate/up are one matmul, and `update_weights` writes HF tensors into views of the fused weights. In bf16 on
a CPU the layers multiply through oneDNN-packed copies of those weights (`_linear`), made once per weight version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from megarl.model_shape import ModelShape
from megarl.rollout.base import Completion, EngineCapabilities, SamplingParams
from megarl.rollout.weight_sync import WeightBucket

_COMPACT_FRACTION = 0.25  # drop ended rows once this share of the batch has ended: copying the cache is not free


@dataclass
class KVCache:
    """Per-call KV cache: keys [layers, batch, kv_heads, head_dim, max_len] (transposed: q @ k needs no copy) and
    values [layers, batch, kv_heads, max_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, v_head_dim: int = 0,
              **kw) -> KVCache:
        """`v_head_dim`: the values' width where it differs from the keys' (MLA); 0 = head_dim."""
        return cls(
            torch.empty(layers, batch, kv_heads, head_dim, max_len, **kw),
            torch.empty(layers, batch, kv_heads, max_len, v_head_dim or head_dim, **kw),
        )

    def repeat_rows(self, n: int) -> KVCache:
        """Each row repeated n times consecutively (row i -> rows i*n .. i*n+n-1)."""
        return KVCache(self.k.repeat_interleave(n, dim=1), self.v.repeat_interleave(n, dim=1))

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        return KVCache(self.k.index_select(1, rows), self.v.index_select(1, rows))


@dataclass
class _Batch:
    """The live rows of one decode, and everything that must stay aligned with them when rows are dropped."""

    cache: KVCache
    rows: torch.Tensor  # [B] original row index (prompt * n + sample) of each live row
    next_pos: torch.Tensor  # [B] position of the token each row feeds next
    key_mask: torch.Tensor  # [B, kv_heads, max_len] additive mask over cache columns: -inf on left padding
    alive: torch.Tensor  # [B] False once a row has emitted a stop token

    def repeat_rows(self, n: int) -> _Batch:
        """Each row repeated n times consecutively; rows are renumbered 0 .. B * n - 1."""
        return _Batch(
            cache=self.cache.repeat_rows(n),
            rows=torch.arange(len(self.rows) * n, device=self.rows.device),
            next_pos=self.next_pos.repeat_interleave(n),
            key_mask=self.key_mask.repeat_interleave(n, dim=0),
            alive=self.alive.repeat_interleave(n),
        )

    def select_rows(self, keep: torch.Tensor) -> _Batch:
        return _Batch(
            self.cache.select_rows(keep), self.rows[keep], self.next_pos[keep], self.key_mask[keep], self.alive[keep]
        )


@dataclass
class _Layer:
    """One decoder layer in the engine's fused layout ([out, in] weights, as F.linear wants)."""

    ln1: torch.Tensor
    wqkv: torch.Tensor | None  # rows: q heads, then k heads, then v heads (None: MLA, `mla`)
    bqkv: torch.Tensor | None
    wo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor  # rows: gate, then up; [experts, 2 * width, hidden] in a mixture-of-experts layer
    wdown: torch.Tensor  # [hidden, width]; [experts, hidden, width] in a mixture-of-experts layer
    qnorm: torch.Tensor | None = None  # Qwen3: RMSNorm weights over each query / key head [head_dim]
    knorm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [experts, hidden]: a mixture-of-experts layer
    router_bias: torch.Tensor | None = None  # [experts]: DeepSeek's e_score_correction_bias
    shared_wgu: torch.Tensor | None = None  # DeepSeek's shared expert: [2 * width, hidden] and [hidden, width]
    shared_wdown: torch.Tensor | None = None
    mla: object | None = None  # DeepSeek-V3: `megarl.models.deepseek_v3.engine.MLAWeights`


class BuiltinEngine(EngineCapabilities):
    """A `RolloutEngine` for Llama / Qwen2 in plain PyTorch (see the module docstring)."""

    shares_actor_weights = False
    scores_distributions = True  # `score_distributions`: the whole vocabulary (the mismatch check)

    def __init__(self, hf_config: dict, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 tokenizer=None):
        """`tokenizer` (anything with `decode(ids, skip_special_tokens=...)`) is needed only for stop strings."""
        self.shape = ModelShape.from_hf_config(hf_config)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_version = 0
        self._mla = None
        if self.shape.is_mla:
            from megarl.models.deepseek_v3 import engine as mla

            self._mla = mla
        self._allocate_weights()
        self._params = self._hf_views()
        self._rope = torch.empty(0, 2, self.shape.head_dim, device=self.device, dtype=self.dtype)
        # bf16 on CPU: the layers' weights also kept in oneDNN's packed layout, re-packed after each weight update
        self._pack = self.device.type == "cpu" and dtype == torch.bfloat16 and _onednn_bf16()
        self._packed: dict[int, torch.Tensor] = {}
        # Mixture of experts: `generate` records every token's experts (`Completion.routed_experts`), which the
        # actor compares with its own and replays with --routing-replay. `_route_into` is where the current forward
        # writes them ([B, T, sparse layers, k]); None: not recording.
        self.records_routing = self.shape.is_moe
        self._sparse_index = {layer: i for i, layer in enumerate(self.shape.moe_layers)}
        self._route_into: torch.Tensor | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, tokenizer=None
    ) -> BuiltinEngine:
        """Build from a Hugging Face checkpoint directory (config.json + *.safetensors)."""
        path = Path(path)
        engine = cls(json.loads((path / "config.json").read_text()), device=device, dtype=dtype, tokenizer=tokenizer)
        loaded: set[str] = set()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in hf_tensors(path):
                loaded.add(name)
                yield name, tensor

        engine.update_weights(tensors(), version=0)
        missing = set(engine._params) - loaded - ({"lm_head.weight"} if engine.shape.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        return engine

    # ---- weights -------------------------------------------------------------------------------------------

    def _allocate_weights(self) -> None:
        s = self.shape
        q, kv = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(size, device=self.device, dtype=self.dtype)

        self.embed = zeros(s.vocab_size, s.hidden_size)
        self.norm = zeros(s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else zeros(s.vocab_size, s.hidden_size)
        def mlp(i: int) -> dict:
            h = s.hidden_size
            if not s.is_moe_layer(i):
                return dict(wgu=zeros(2 * s.ffn_hidden_size, h), wdown=zeros(h, s.ffn_hidden_size))
            e, f, shared = s.num_experts, s.moe_ffn_hidden_size, s.moe_shared_ffn_hidden_size
            return dict(wgu=zeros(e, 2 * f, h), wdown=zeros(e, h, f), router=zeros(e, h),
                        router_bias=zeros(e) if s.moe_expert_bias else None,
                        shared_wgu=zeros(2 * shared, h) if shared else None,
                        shared_wdown=zeros(h, shared) if shared else None)

        def attention() -> dict:
            if self._mla is not None:
                return dict(wqkv=None, bqkv=None, wo=None, mla=self._mla.allocate(s, zeros))
            return dict(wqkv=zeros(q + 2 * kv, s.hidden_size), bqkv=zeros(q + 2 * kv) if s.qkv_bias else None,
                        wo=zeros(s.hidden_size, q))

        self.layers = [
            _Layer(
                ln1=zeros(s.hidden_size),
                **attention(),
                ln2=zeros(s.hidden_size),
                qnorm=zeros(s.head_dim) if s.qk_norm else None,
                knorm=zeros(s.head_dim) if s.qk_norm else None,
                **mlp(i),
            )
            for i in range(s.num_layers)
        ]

    def _hf_views(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> the view of the engine's (fused) tensor that holds it."""
        s = self.shape
        q, kv, inter = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.ffn_hidden_size
        views = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm,
                 "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            views[p + "input_layernorm.weight"] = layer.ln1
            views[p + "post_attention_layernorm.weight"] = layer.ln2
            if layer.mla is not None:
                views.update(self._mla.hf_views(layer.mla, p))
            else:
                for proj, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
                    views[f"{p}self_attn.{proj}_proj.weight"] = layer.wqkv[rows]
                    if layer.bqkv is not None:
                        views[f"{p}self_attn.{proj}_proj.bias"] = layer.bqkv[rows]
                views[p + "self_attn.o_proj.weight"] = layer.wo
            if layer.qnorm is not None:
                views[p + "self_attn.q_norm.weight"] = layer.qnorm
                views[p + "self_attn.k_norm.weight"] = layer.knorm
            if layer.router is None:
                views[p + "mlp.gate_proj.weight"] = layer.wgu[:inter]
                views[p + "mlp.up_proj.weight"] = layer.wgu[inter:]
                views[p + "mlp.down_proj.weight"] = layer.wdown
                continue
            views[p + "mlp.gate.weight"] = layer.router
            if layer.router_bias is not None:
                views[p + "mlp.gate.e_score_correction_bias"] = layer.router_bias
            if layer.shared_wgu is not None:
                shared = s.moe_shared_ffn_hidden_size
                views[p + "mlp.shared_experts.gate_proj.weight"] = layer.shared_wgu[:shared]
                views[p + "mlp.shared_experts.up_proj.weight"] = layer.shared_wgu[shared:]
                views[p + "mlp.shared_experts.down_proj.weight"] = layer.shared_wdown
            f = s.moe_ffn_hidden_size
            for e in range(s.num_experts):  # HF's on-disk names: one tensor per expert
                views[f"{p}mlp.experts.{e}.gate_proj.weight"] = layer.wgu[e, :f]
                views[f"{p}mlp.experts.{e}.up_proj.weight"] = layer.wgu[e, f:]
                views[f"{p}mlp.experts.{e}.down_proj.weight"] = layer.wdown[e]
        return views

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Copy HF-named tensors (all or a subset) into the engine; tensors stream, so an error stops midway."""
        for name, tensor in named_tensors:
            dst = self._params.get(name)
            if dst is None:
                raise KeyError(
                    f"BuiltinEngine.update_weights: unknown parameter {name!r} for a {self.shape.family} model "
                    f"with {self.shape.num_layers} layers (expected Hugging Face names such as "
                    f"'model.layers.0.self_attn.q_proj.weight')"
                )
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(
                    f"BuiltinEngine.update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            self._packed.clear()  # stale; re-packed at the next forward
        self.weight_version = self.weight_version + 1 if version is None else version

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Each bucket's tensors are views into its flat bytes: copied into the engine's weights, no other copy."""
        for bucket in buckets:
            self.update_weights(bucket.tensors(), version=version)
        self.weight_version = version

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear; for bf16 on CPU through a oneDNN-packed copy of the weight (bitwise the same result).

        Decoding multiplies a few rows by every weight at every step, and the weights do not fit in cache: aten's
        bf16 matmul re-lays each weight out for oneDNN on every call, about 40% on top of the multiply at 32 rows
        (8 layers of the 30M bench model: 7.9 against 5.6 ms per step). The packed copy is made once per weight
        version."""
        if not self._pack:
            return F.linear(x, weight, bias)
        packed = self._packed.get(id(weight))
        if packed is None:
            packed = self._packed[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def release_memory(self, keep_weights: bool = False) -> None:
        """Nothing to free: the KV cache lives only for one `generate` call."""

    def resume_memory(self) -> None:
        """Nothing to re-acquire (see `release_memory`); nothing is cached across calls."""

    def shutdown(self) -> None:
        """Nothing runs beside this process."""

    # ---- the transformer -----------------------------------------------------------------------------------

    def _ensure_rope(self, length: int) -> None:
        """RoPE table [length, 2, head_dim] of (cos, signed sin), in HF's half-split (`rotate_half`) convention.

        HF computes x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Moving the minus sign into
        the table turns the rotation into roll(x) = cat(x2, x1): one op fewer per layer and step."""
        if length <= len(self._rope):
            return
        length = max(length, 2 * len(self._rope), 256)  # grow geometrically: few rebuilds over a run
        s = self.shape
        inv_freq = s.rope_inv_freq()
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self._mla is not None:  # YaRN scales cos and sin (by 1 without it)
            cos, sin = cos * self._mla.rope_scaling(s), sin * self._mla.rope_scaling(s)
        table = torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)
        self._rope = table.to(self.device, self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.shape.norm_eps)
        # Like HF: normalise in fp32, cast back, then scale, so low-precision runs match the actor's rounding.
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.norm_eps).to(x.dtype)

    def _attention(
        self,
        x: torch.Tensor,
        layer: _Layer,
        rope: torch.Tensor,
        mask: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
        start: int,
    ) -> torch.Tensor:
        """Self-attention of x [B, T, hidden]. With one layer's cache `kv` (see `KVCache`), the new keys and values
        go to columns start..start+T and attention covers columns 0..start+T."""
        if layer.mla is not None:
            return self._mla.attention(self, x, layer.mla, rope, mask, kv, start)
        s = self.shape
        B, T, _ = x.shape
        nq, nkv, hd = s.num_attention_heads, s.num_kv_heads, s.head_dim
        qkv = self._linear(x, layer.wqkv, layer.bqkv).view(B, T, nq + 2 * nkv, hd)
        qk = qkv[:, :, : nq + nkv]
        if layer.qnorm is not None:  # Qwen3: each query and key head normalised before RoPE
            qk = torch.cat([self._rms_norm(qk[:, :, :nq], layer.qnorm), self._rms_norm(qk[:, :, nq:], layer.knorm)], 2)
        qk = torch.addcmul(qk * rope[..., 0, :], qk.roll(hd // 2, dims=-1), rope[..., 1, :])
        q, k, v = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), qkv[:, :, nq + nkv :].transpose(1, 2)
        if kv is not None:
            k_cache, v_cache = kv
            end = start + T
            k_cache[..., start:end] = k.transpose(2, 3)
            v_cache[:, :, start:end] = v
            if T == 1:
                out = self._decode_attention(q, k_cache[..., :end], v_cache[:, :, :end], mask)
                return self._linear(out, layer.wo)
            k, v = k_cache[..., :end].transpose(2, 3), v_cache[:, :, :end]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nq)
        return self._linear(out.transpose(1, 2).reshape(B, T, nq * hd), layer.wo)

    def _decode_attention(self, q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """Attention of one new token per row: q [B, heads, 1, hd], k_t [B, kv_heads, hd, L], v [B, kv_heads, L, hd],
        additive mask [B * kv_heads, 1, L] -> [B, 1, heads * hd].

        The query heads sharing a kv head act as that head's queries, so GQA needs no repeated keys (there is no
        causal structure among them; the mask is per key). `baddbmm` folds the scale and the mask into the matmul."""
        s = self.shape
        B = q.shape[0]
        q = q.reshape(B * s.num_kv_heads, s.num_attention_heads // s.num_kv_heads, s.head_dim)
        scores = torch.baddbmm(mask, q, k_t.flatten(0, 1), alpha=s.head_dim**-0.5)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)  # fp32 softmax, as SDPA does internally
        return torch.bmm(probs, v.flatten(0, 1)).view(B, 1, s.num_attention_heads * s.head_dim)

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] for token ids [B, T] at positions `pos` [B, T]. `mask` is SDPA's
        [B, 1, T, T] when T > 1 and `_decode_attention`'s [B * kv_heads, 1, start + 1] when T == 1."""
        h = F.embedding(ids, self.embed)
        rope = self._rope[pos].unsqueeze(2)  # [B, T, 1, 2, head_dim]: broadcasts over heads
        for i, layer in enumerate(self.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            h += self._attention(self._rms_norm(h, layer.ln1), layer, rope, mask, kv, start)
            if layer.router is not None:
                h += self._moe(self._rms_norm(h, layer.ln2), layer, i)
                continue
            gu = self._linear(self._rms_norm(h, layer.ln2), layer.wgu)
            inter = self.shape.ffn_hidden_size
            h += self._linear(F.silu(gu[..., :inter]) * gu[..., inter:], layer.wdown)
        return self._rms_norm(h, self.norm)

    def _moe(self, x: torch.Tensor, layer: _Layer, index: int) -> torch.Tensor:
        """Qwen3-MoE's sparse MLP of x [B, T, hidden]: router logits in fp32, a softmax over every expert, the top-k
        (renormalised with `norm_topk_prob`), and the weighted sum of those experts' SwiGLU outputs. DeepSeek-V3:
        its own router (`deepseek_v3.engine.route`), and the shared expert added."""
        s = self.shape
        flat = x.reshape(-1, x.shape[-1])
        if s.moe_score_function == "sigmoid":
            logits = F.linear(flat.float(), layer.router.float())
            weights, experts = self._mla.route(s, logits, layer.router_bias)
            probs = logits.sigmoid()
        else:
            probs = F.linear(flat.float(), layer.router.float()).softmax(dim=-1)
            weights, experts = torch.topk(probs, s.moe_top_k, dim=-1)
            if s.moe_norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        self._record_routing(index, experts, probs)
        out = torch.zeros_like(flat)
        f = s.moe_ffn_hidden_size
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            gu = F.linear(flat[rows], layer.wgu[e])
            y = F.linear(F.silu(gu[:, :f]) * gu[:, f:], layer.wdown[e])
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        if layer.shared_wgu is not None:
            gu, shared = self._linear(flat, layer.shared_wgu), s.moe_shared_ffn_hidden_size
            out += self._linear(F.silu(gu[:, :shared]) * gu[:, shared:], layer.shared_wdown)
        return out.view_as(x)

    def _record_routing(self, layer: int, experts: torch.Tensor, probs: torch.Tensor) -> None:
        """Write layer `layer`'s experts [B * T, k] into the current forward's routing buffer, if one is set."""
        if self._route_into is not None:
            out = self._route_into[:, :, self._sparse_index[layer]]
            out.copy_(experts.view(out.shape))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head).float()

    # ---- batching helpers ----------------------------------------------------------------------------------

    def _left_pad(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids [B, L], positions [B, L] (0 at each row's first real token) and pad lengths [B]."""
        if any(len(seq) == 0 for seq in seqs):
            raise ValueError("BuiltinEngine: every prompt / sequence needs at least one token")
        width = max(len(seq) for seq in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
        pads = torch.tensor([width - len(seq) for seq in seqs], dtype=torch.long)
        pos = (torch.arange(width) - pads[:, None]).clamp(min=0)
        self._ensure_rope(width + 1)
        return ids.to(self.device), pos.to(self.device), pads.to(self.device)

    def _key_mask(self, pads: torch.Tensor, width: int) -> torch.Tensor:
        """Additive mask [B, width]: -inf over each row's left padding, 0 elsewhere."""
        cols = torch.arange(width, device=self.device)
        mask = torch.zeros(len(pads), width, device=self.device, dtype=self.dtype)
        return mask.masked_fill_(cols[None, :] < pads[:, None], float("-inf"))

    def _prefill_mask(self, key_mask: torch.Tensor, width: int) -> torch.Tensor:
        """Causal + padding mask [B, 1, width, width]; the diagonal stays open so pad rows never see only -inf."""
        causal = torch.full((width, width), float("-inf"), device=self.device, dtype=self.dtype).triu_(1)
        mask = causal[None] + key_mask[:, None, :width]
        mask.diagonal(dim1=1, dim2=2).zero_()
        return mask[:, None]

    # ---- scoring and generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of each sequence's tokens after its prompt, from one full forward (no cache)."""
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"score: {len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        for seq, plen in zip(sequences, prompt_lens):
            if not 1 <= plen <= len(seq):
                raise ValueError(f"score: prompt length {plen} not in [1, {len(seq)}]")
        ids, pos, pads = self._left_pad(sequences)
        width = ids.shape[1]
        logits = self._logits(self._forward(ids, pos, self._prefill_mask(self._key_mask(pads, width), width)))
        if temperature > 0:
            logits = logits / temperature
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None]).squeeze(2).cpu()
        # Token at padded column c is predicted at column c - 1.
        return [
            logp[row, width - len(seq) + plen - 1 :].tolist()
            for row, (seq, plen) in enumerate(zip(sequences, prompt_lens))
        ]

    @torch.inference_mode()
    def score_distributions(self, sequences: list[list[int]], prompt_lens: list[int],
                            temperature: float = 1.0) -> list[torch.Tensor]:
        """The whole next-token distribution at each token after its prompt: per sequence, log-probs
        [len(seq) - prompt_len, vocab] (float32, on the CPU), row j the distribution token prompt_len + j was drawn
        from (`megarl.rollout.mismatch`). One full forward, as `score`."""
        ids, pos, pads = self._left_pad(sequences)
        width = ids.shape[1]
        logits = self._logits(self._forward(ids, pos, self._prefill_mask(self._key_mask(pads, width), width)))
        if temperature > 0:
            logits = logits / temperature
        logp = torch.log_softmax(logits[:, :-1], dim=-1).cpu()
        return [logp[row, width - len(seq) + plen - 1 :] for row, (seq, plen) in enumerate(zip(sequences, prompt_lens))]

    reports_finished_rows = True  # `generate(..., on_finish=)`: a rollout function may score rows as they stop

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_finish: Callable[[int, Completion], None] | None = None) -> list[list[Completion]]:
        """Sample `params.n` completions per prompt, all in one batch; result[i] is prompt i's group.
        `on_finish(row, completion)` is called as each row stops, while the others decode (row = prompt * n +
        sample; the completion as `generate` will return it, without `routed_experts`); rows cut at the length
        limit are not reported (they all end with the batch)."""
        if not prompts:
            return []
        batch, logits, width = self._prefill(prompts, params)
        prompt_routing, self._prompt_routing = self._prompt_routing, None
        tokens, logprobs, ends = self._decode(batch, logits, width, params, on_finish)
        response_routing, self._response_routing = self._response_routing, None
        groups = self._completions(tokens, logprobs, ends, len(prompts), params)
        if prompt_routing is not None:
            for p, (prompt, group) in enumerate(zip(prompts, groups)):
                fed_prompt = prompt_routing[p, width - len(prompt) :]  # left padding dropped
                for j, c in enumerate(group):
                    # Every token the engine ran: the prompt, and the response but its last token.
                    fed = response_routing[p * params.n + j, : len(c.token_ids) - 1]
                    c.routed_experts = torch.cat([fed_prompt, fed]).cpu()
        return groups

    _prompt_routing: torch.Tensor | None = None  # [prompts, width, sparse layers, k] from the last prefill
    _response_routing: torch.Tensor | None = None  # [rows, max_new_tokens, sparse layers, k] from the last decode

    def _routing_buffer(self, *size: int) -> torch.Tensor | None:
        if not self.records_routing:
            return None
        return torch.full((*size, len(self.shape.moe_layers), self.shape.moe_top_k), -1, dtype=torch.int16,
                          device=self.device)

    def _prefill(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> tuple[_Batch, torch.Tensor, int]:
        """Run each distinct prompt once, then copy its cache to its n sample rows. Returns the decode batch, the
        fp32 logits of each row's next token and the padded prompt width (the cache column of the first new token)."""
        s, n = self.shape, params.n
        ids, pos, pads = self._left_pad(prompts)
        num_prompts, width = ids.shape
        max_len = width + params.max_new_tokens
        self._ensure_rope(max_len)
        key_mask = self._key_mask(pads, max_len)
        heads, k_dim, v_dim = self._mla.cache_dims(s) if self._mla is not None else (s.num_kv_heads, s.head_dim, 0)
        cache = KVCache.empty(s.num_layers, num_prompts, heads, max_len, k_dim, v_dim, device=self.device,
                              dtype=self.dtype)
        self._route_into = self._prompt_routing = self._routing_buffer(num_prompts, width)
        try:
            logits = self._logits(self._forward(ids, pos, self._prefill_mask(key_mask, width), cache, 0)[:, -1])
        finally:
            self._route_into = None
        batch = _Batch(
            cache=cache,
            rows=torch.arange(num_prompts, device=self.device),
            next_pos=pos[:, -1] + 1,
            key_mask=key_mask[:, None].expand(-1, s.num_kv_heads, -1).contiguous(),
            alive=torch.ones(num_prompts, dtype=torch.bool, device=self.device),
        )
        if n == 1:
            return batch, logits, width
        return batch.repeat_rows(n), logits.repeat_interleave(n, dim=0), width

    def _decode(
        self, batch: _Batch, logits: torch.Tensor, width: int, params: SamplingParams,
        on_finish: Callable[[int, Completion], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step-by-step decoding. Returns tokens and log-probs [rows, max_new_tokens] and, per row, the step at
        which it emitted a stop token (-1: none)."""
        rows_total, max_new = logits.shape[0], params.max_new_tokens
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        stop_text = StopStrings(params.stop, self.tokenizer) if params.stop else None
        tokens = torch.zeros(rows_total, max_new, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows_total, max_new, dtype=torch.float32, device=self.device)
        ends = torch.full((rows_total,), -1, dtype=torch.long, device=self.device)
        self._response_routing = routed = self._routing_buffer(rows_total, max_new)
        for step in range(max_new):
            tok, lp = _sample(logits, params, generator)
            tokens[batch.rows, step], logprobs[batch.rows, step] = tok, lp
            if params.stop_token_ids or stop_text is not None:
                hit = torch.isin(tok, stop_ids).logical_and_(batch.alive)
                if stop_text is not None:
                    hit |= stop_text.hits(tokens, batch.rows, step).logical_and_(batch.alive)
                if bool(hit.any()):  # the only host sync per step, and only when stops are asked for
                    ends[batch.rows[hit]] = step
                    batch.alive &= ~hit
                    if on_finish is not None:
                        for row in batch.rows[hit].tolist():
                            on_finish(row, Completion(tokens[row, : step + 1].tolist(),
                                                      logprobs[row, : step + 1].tolist(), "stop", self.weight_version))
                    live = int(batch.alive.sum())
                    if live == 0:
                        break
                    if live <= (1 - _COMPACT_FRACTION) * len(tok):
                        keep = batch.alive.nonzero().squeeze(1)
                        batch, tok = batch.select_rows(keep), tok[keep]
            if step == max_new - 1:
                break
            col = width + step
            mask = batch.key_mask[:, :, None, : col + 1].flatten(0, 1)
            self._route_into = self._routing_buffer(len(tok), 1)
            try:
                hidden = self._forward(tok[:, None], batch.next_pos[:, None], mask, batch.cache, col)
                logits = self._logits(hidden[:, -1])
            finally:
                step_routing, self._route_into = self._route_into, None
            if routed is not None:
                routed[batch.rows, step] = step_routing[:, 0]
            batch.next_pos += 1
        return tokens, logprobs, ends

    def _completions(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, ends: torch.Tensor, num_prompts: int, params: SamplingParams
    ) -> list[list[Completion]]:
        tokens, logprobs, ends = tokens.tolist(), logprobs.tolist(), ends.tolist()
        completions = []
        for row, end in enumerate(ends):
            length = params.max_new_tokens if end < 0 else end + 1
            completions.append(
                Completion(
                    token_ids=tokens[row][:length],
                    logprobs=logprobs[row][:length],
                    finish_reason="length" if end < 0 else "stop",
                    weight_version=self.weight_version,
                )
            )
        return [completions[i * params.n : (i + 1) * params.n] for i in range(num_prompts)]


def hf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of an HF checkpoint directory's *.safetensors files, one at a time (what an engine's
    `update_weights` takes); FileNotFoundError when it has none."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                    continue
                yield name, f.get_tensor(name)


class StopStrings:
    """Which rows' new tokens now spell one of `stops`. Each step decodes only the tail of each row that could
    hold a stop string completed by the newest token: as many tokens as the longest stop string has bytes (every
    token decodes to at least one byte; special tokens are decoded as their text), plus one."""

    def __init__(self, stops: Sequence[str], tokenizer):
        if tokenizer is None:
            raise ValueError("SamplingParams.stop needs the engine's tokenizer to match text: build the built-in "
                             "engine with BuiltinEngine(..., tokenizer=...)")
        self.stops, self.tokenizer = tuple(stops), tokenizer
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 1

    def hits(self, tokens: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """[len(rows)] bool: row `rows[i]`'s tokens up to `step` end in a stop string completed at `step`."""
        tails = tokens[rows, max(0, step + 1 - self.window) : step + 1].tolist()
        found = [any(s in self.tokenizer.decode(t, skip_special_tokens=False) for s in self.stops) for t in tails]
        return torch.tensor(found, dtype=torch.bool, device=tokens.device)


def _onednn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def _sample(logits: torch.Tensor, params: SamplingParams,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token [B] and its log-prob [B] from fp32 logits [B, vocab]; the log-prob ignores top-k/top-p."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
    else:
        scaled = logits if params.temperature == 1.0 else logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        kept = _truncate(logp, params.top_k, params.top_p)
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), draws from p; it needs no normalised p and no sync.
        noise = torch.empty_like(kept).exponential_(generator=generator)
        tok = (kept.exp() / noise).argmax(dim=-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def _truncate(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs with tokens outside the top-k, then outside the top-p nucleus, set to -inf (HF's order)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.softmax(dim=-1)  # renormalised after top-k
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the tokens above already reach top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp


class CheckpointTokenizer:
    """The checkpoint's tokenizer, loaded when first used (stop strings): a run without them never loads it."""

    def __init__(self, path: str):
        self.path, self._tokenizer = path, None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
