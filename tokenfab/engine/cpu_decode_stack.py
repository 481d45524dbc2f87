"""Decode-only CPU steps through the whole decoder stack in one C++ call (kernels/cpu/csrc/decode_stack.cpp).

After the per-layer fusions (``cpu_decode_blocks.mla_decode`` / ``gqa_decode``, the packed MoE dispatch), a batch-1
decode step of the default DeepSeek model still spent ~0.8 ms of its ~3.8 ms in Python between ~50 kernel calls:
module calls, argument lists, the router's float cast, residual adds (benchmarks/NOTES.md entry 38). Here the
model's layers are described once, after loading, to a C++ ``DecodeStack`` that keeps their weights and sizes and
runs embedding -> layers -> final norm with the same kernels in the same order, so hidden states and KV-cache
writes are bit-identical to ``CausalLM.forward`` (tests/test_decode_stack.py). It also skips building the step's
AttentionMetadata, which the stack does not read.

Covered: single-device models made of ``DecoderLayer``s whose attention runs as one fused block (MLA or
grouped-query) and whose MLP is a packed SiLU-GLU, DeepSeek-V3's MoE (sigmoid group-limited router, packed routed
experts, optional shared expert; or its routed experts kept packed on their C++ kernel, RoutedExperts.q13 /
q2: FP8 block-scaled, INT4 group-32, MXFP4) or Qwen3-MoE's (softmax top-k router, packed routed experts). Grouped-query layers,
dense SiLU-GLUs, the embedding and the LM head may also hold GGUF weights kept packed
(:class:`~tokenfab.quant.gguf_weight.GGUFWeight` on its C++ kernel): a ``.gguf`` file served packed runs the same
one-call step, its linears multiplied by ``gguf_linear`` from C++ (q|k|v and gate|up joined when their block types
match, as ``Linear.concat`` joined them; tests/test_decode_stack_packed.py). FP8 block-scaled weights (:class:`~tokenfab.quant.fp8_block_weight.
Fp8BlockWeight` on its C++ kernel, DeepSeek-V3 / Kimi-K2 checkpoints) may fill the same Lins, and MLA layers whose
projections are such Lins run mla_decode's steps with them (tests/test_fp8_block_weight.py).

On CPUs without AVX512-BF16 (the ``avx2`` ISA level, where tokenfab computes in float32) a GGUF file served
packed runs the same one-call step in float32: grouped-query layers and dense SiLU-GLUs whose every linear, the LM
head included, is a GGUF weight on the AVX2 GEMV (``GGUFWeight._gemv_avx2``; Lins of type ``GGUF_AVX2_QTYPE`` + the
ggml type), the packed embedding dequantized to float32, float32 norms and KV pool (tests/test_decode_stack_avx2.py).
A batch-1 step of SmolLM2's Q4_1 file there was mostly Python between ~300 kernel calls (benchmarks/NOTES.md).

Anything else (tensor parallel, hybrid KDA models, oneDNN or plain-PyTorch linears, float32 weights that are not
GGUF on the AVX2 GEMV, other compressed formats or GGUF weights on the PyTorch reference path) keeps the module
path: :meth:`CpuDecodeStack.build` returns None.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenfab.kernels.cpu import build as cpu_build
from tokenfab.kernels.cpu.ops import support as cpu_support
from tokenfab.layers.linear import Linear
from tokenfab.layers.mla import MLAttention
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.moe import RoutedExperts, SigmoidGroupRouter, SoftmaxTopKRouter
from tokenfab.layers.packed_embedding import PackedEmbedding
from tokenfab.models.base import CausalLM
from tokenfab.models.deepseek_v3 import DeepseekV3MoE
from tokenfab.models.llama import DecoderLayer, LlamaAttention
from tokenfab.models.qwen3_moe import Qwen3MoeBlock
from tokenfab.quant.fp8_block_weight import Fp8BlockWeight
from tokenfab.quant.gguf_weight import GGUFWeight
from tokenfab.quant.packed_weight import PackedWeight


_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # DecodeStack.forward computes the slots itself
FP8_LIN_QTYPE = 256  # decode_stack.cpp's kFp8LinQtype: a Lin over FP8 block-scaled bytes (fp8_block_linear)
FP8_LIN_TILED_QTYPE = 257  # kFp8LinTiledQtype: the same with whole 16-row tiles in the CPU tile layout
GGUF_AVX2_QTYPE = 512  # decode_stack.cpp's kGgufAvx2Qtype: + the ggml type, a GGUF Lin on the AVX2 GEMV


class CpuDecodeStack:
    """The C++ decoder stack of one model and its KV pool; :meth:`run` replaces ``model(...)`` for decode-only
    steps. Build with :meth:`build`."""

    def __init__(self, stack, caches: list[torch.Tensor], block_size: int, vocab_size: int | None):
        self._stack = stack
        self._caches = caches  # flattened in layer order: MLA latent pool, or k and v pools
        self.block_size = block_size
        self.vocab_size = vocab_size  # set when the LM head is in the stack (run_sample), else None

    @classmethod
    def build(cls, model: nn.Module, kv_caches: list, block_size: int) -> CpuDecodeStack | None:
        """The stack for ``model`` (weights loaded and fused, ``post_load`` done) over ``kv_caches`` (from
        ``model.make_kv_cache``), or None when some part of the model is outside what the stack covers."""
        ext = cpu_build.load()
        if ext is None or not hasattr(ext, "DecodeStack"):
            return None
        # bf16 on tokenfab's AVX512-BF16 kernels; else float32 with every linear on the AVX2 GGUF GEMV
        dtype = torch.bfloat16 if cpu_support.has_bf16_dot() else torch.float32
        if not isinstance(model, CausalLM) or type(model).forward is not CausalLM.forward or model.tp is not None:
            return None
        emb, norm = model.model.embed_tokens, model.model.norm
        if type(emb) is nn.Embedding and dtype == torch.bfloat16:
            embed, packed_embed = emb.weight, None
        elif type(emb) is PackedEmbedding and emb.dtype == dtype and _gguf_rows(emb.qweight):
            embed, packed_embed = emb.qweight.tiles, emb.qweight
        else:
            return None
        if ((packed_embed is None and embed.dtype != dtype) or embed.device.type != "cpu"
                or norm.weight.dtype != dtype):
            return None
        if getattr(model, "host_expert_stats", None) is not None:  # host-offloaded experts: the module path
            return None
        kernel = (lambda m: _gguf_kernel(m) or _fp8_kernel(m)) if dtype == torch.bfloat16 else _gguf_avx2
        if any(isinstance(m, PackedWeight) and not kernel(m) for m in model.modules()):
            return None  # compressed weights the stack does not run (other formats, GGUF / FP8 on the PyTorch path)
        layers = list(model.model.layers)
        if not layers or len(layers) != len(kv_caches):
            return None
        rotary = getattr(layers[0].self_attn, "rotary", None)
        if rotary is None or getattr(rotary, "cos", None) is None or rotary.cos.dtype != torch.float32:
            return None
        stack = ext.DecodeStack(embed, norm.weight, float(norm.eps), rotary.cos, rotary.sin, bool(rotary.interleave))
        if packed_embed is not None:
            stack.set_gguf_embedding(packed_embed.tiles, packed_embed.block.ggml_type, packed_embed.out_features,
                                     dtype == torch.bfloat16)
        caches: list[torch.Tensor] = []
        for layer, cache in zip(layers, kv_caches):
            if type(layer) is not DecoderLayer or layer.tp is not None or layer.self_attn.rotary is not rotary:
                return None
            if not ((_add_attention(stack, layer, cache, caches) or _add_mla_lin(stack, layer, cache, caches)
                     or _add_gqa_lin(stack, layer, cache, caches))
                    and _add_mlp(stack, layer.mlp)):
                return None
        # pools of the stack's dtype; at the float32 level also bf16 / fp16 pools (EngineConfig.kv_cache_dtype):
        # the kernels round the rows they write to the pool and widen the rows attention reads
        pools = (dtype,) if dtype == torch.bfloat16 else (dtype, torch.bfloat16, torch.float16)
        if any(c.dtype not in pools or c.device.type != "cpu" or not c.is_contiguous() for c in caches):
            return None
        lm_head = getattr(model, "_lm_head_packed", None)  # packed by CausalLM.post_load (untied heads)
        qhead = getattr(model, "_lm_head_qweight", None)  # a compressed head (GGUF; tied: the packed embedding)
        vocab = None
        if qhead is not None:
            spec = _gguf_spec(qhead, None)
            if spec is not None:
                vocab = int(qhead.out_features)
                stack.set_lm_head_lin(spec)
        elif lm_head is not None and not lm_head.is_mkldnn:
            vocab = int(model._lm_head_rows)
            stack.set_lm_head(lm_head, vocab)
        return cls(stack, caches, block_size, vocab)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray | None, bt: np.ndarray,
            context_lens: np.ndarray) -> torch.Tensor:
        """One decode token per sequence: input_ids, positions, slots, context_lens [B] int64 numpy; bt [B, >=
        blocks needed] int64 block tables. ``slots`` None: computed in C++ from positions and bt (slot =
        bt[i, pos // block_size] * block_size + pos % block_size, as ``ModelRunner._slots``). Returns the
        final-normed hidden states [B, hidden] bf16 (what ``CausalLM.forward`` returns), after writing this step's
        K/V rows. Raises RuntimeError for a position past its block table."""
        return self._stack.forward(*self._step_tensors(input_ids, positions, slots, bt, context_lens))

    def run_sample(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray | None, bt: np.ndarray,
                   context_lens: np.ndarray, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """:meth:`run`, then the LM head and one token per sequence drawn as ``Sampler`` draws plain rows
        (``cpu_sampling.sample_plain`` at temperatures ``temps`` [B] float32 with uniforms ``u`` [B], from
        ``Sampler.plain_inputs``), all in one C++ call: no Python runs between the forward and the draw, where
        every interpreter step pays for the caches the forward's weight stream evicted (benchmarks/NOTES.md
        entry 38). Only when ``vocab_size`` is set. Returns int64 [B]."""
        return self._stack.forward_sample(*self._step_tensors(input_ids, positions, slots, bt, context_lens), temps, u)

    def _step_tensors(self, input_ids, positions, slots, bt, context_lens) -> tuple:
        nblk = int((context_lens.max() + self.block_size - 1) // self.block_size)
        return (torch.from_numpy(input_ids), torch.from_numpy(positions),
                _NO_SLOTS if slots is None else torch.from_numpy(slots), self._caches,
                torch.from_numpy(np.ascontiguousarray(bt[:, :nblk])), torch.from_numpy(context_lens))


def _add_attention(stack, layer: DecoderLayer, cache, caches: list[torch.Tensor]) -> bool:
    attn, n_in, n_post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    norms = (n_in.weight, float(n_in.eps), n_post.weight, float(n_post.eps))
    args = attn.decode_block_args() if isinstance(attn, (MLAttention, LlamaAttention)) and attn.decode_block else None
    if args is None:
        return False
    if type(attn) is MLAttention:
        w, dims, eps_q, eps_kv = args
        stack.add_mla_layer(*norms, w, dims, float(eps_q), float(eps_kv), float(attn.scale))
        caches.append(cache)
        return True
    if isinstance(attn, LlamaAttention):
        w, biases, dims, eps = args
        stack.add_gqa_layer(*norms, w, biases, dims, float(eps), float(attn.scale))
        caches.extend(cache)
        return True
    return False


def _add_gqa_lin(stack, layer: DecoderLayer, cache, caches: list[torch.Tensor]) -> bool:
    """A grouped-query layer whose projections are not all VNNI blocks (GGUF weights kept packed): the stack runs
    LlamaAttention.forward's module path with each projection a Lin (``_lin_spec``)."""
    attn, n_in, n_post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if (not isinstance(attn, LlamaAttention) or not attn.decode_block or not attn.num_heads
            or attn.rot_dim != attn.head_dim or attn.rotary.cos.dtype != torch.float32):
        return False
    projs = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    specs, o = [_lin_spec(p) for p in projs], _lin_spec(attn.o_proj)
    if o is None or any(s is None for s in specs):
        return False
    qk_norms = [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else []
    stack.add_gqa_layer_lin(n_in.weight, float(n_in.eps), n_post.weight, float(n_post.eps), specs, o, qk_norms,
                            [attn.num_heads, attn.num_kv_heads, attn.head_dim],
                            float(attn.q_norm.eps) if attn.qk_norm else 0.0, float(attn.scale))
    caches.extend(cache)
    return True


def _add_mla_lin(stack, layer: DecoderLayer, cache, caches: list[torch.Tensor]) -> bool:
    """An MLA layer whose projections are not all VNNI blocks (FP8 weights kept packed): the stack runs
    mla_decode's steps with q_a|kv_a (or q_a and kv_a), q_b and o_proj as Lins (``_lin_spec``); kv_b_proj's absorbed
    W_UK / W_UV must be on the per-head GEMM kernel."""
    attn, n_in, n_post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if (type(attn) is not MLAttention or not attn.decode_block or attn.q_lora_rank is None
            or not getattr(attn, "_head_gemm", False) or attn.rotary.cos.dtype != torch.float32):
        return False
    fused = getattr(attn, "qkv_a_proj", None)
    a = [_lin_spec(fused)] if fused is not None else [_lin_spec(attn.q_a_proj), _lin_spec(attn.kv_a_proj_with_mqa)]
    q_b, o = _lin_spec(attn.q_b_proj), _lin_spec(attn.o_proj)
    if q_b is None or o is None or any(s is None or s[3] is not None for s in a + [q_b, o]):
        return False  # mla_decode's projections have no biases
    dims = [attn.q_lora_rank, attn.kv_lora, attn.rope_dim, attn.num_heads, attn.nope, attn.v_dim,
            attn.o_proj.out_features]
    stack.add_mla_layer_lin(n_in.weight, float(n_in.eps), n_post.weight, float(n_post.eps), a, q_b, o,
                            [attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, attn._w_uk, attn._w_uv_t], dims,
                            float(attn.q_a_layernorm.eps), float(attn.kv_a_layernorm.eps), float(attn.scale))
    caches.append(cache)
    return True


def _fp8_kernel(w) -> bool:
    """True for an FP8 block weight that runs its C++ kernel (``Fp8BlockWeight.prepare`` chose it)."""
    return isinstance(w, Fp8BlockWeight) and w._kernel and w.weight.device.type == "cpu"


def _gguf_kernel(w) -> bool:
    """True for a GGUF weight that runs its C++ kernel (``GGUFWeight.prepare`` chose it)."""
    return isinstance(w, GGUFWeight) and w._kernel and w.tiles.device.type == "cpu"


def _gguf_avx2(w) -> bool:
    """True for a GGUF weight that runs the AVX2 GEMV (``GGUFWeight.prepare`` chose it: the avx2 ISA level)."""
    return isinstance(w, GGUFWeight) and w._gemv_avx2 and w.tiles.device.type == "cpu"


def _gguf_rows(w) -> bool:
    """True for a GGUF weight whose rows ``gguf_embedding`` dequantizes in C++ (on either kernel)."""
    return _gguf_kernel(w) or _gguf_avx2(w)


def _gguf_spec(q, bias) -> tuple | None:
    """The Lin of a GGUF weight: (tiles, ggml type, rows, bias) on its AVX512 kernel, the type offset by
    GGUF_AVX2_QTYPE on the AVX2 GEMV; None on the PyTorch path."""
    if _gguf_kernel(q):
        return (q.tiles, q.block.ggml_type, q.out_features, bias)
    if _gguf_avx2(q):
        return (q.tiles, GGUF_AVX2_QTYPE + q.block.ggml_type, q.out_features, bias)
    return None


def _lin_spec(lin: Linear | None) -> tuple | None:
    """(weight, ggml type or -1, out_features, bias) of a Linear for the C++ stack: its VNNI blocks (-1) or its
    GGUF tiles (:func:`_gguf_spec`); (bytes, FP8_LIN_QTYPE or FP8_LIN_TILED_QTYPE, out_features, bias, scale_inv)
    for an FP8 block weight;
    None for any other form (oneDNN, plain, another compressed format)."""
    if lin is None:
        return None
    if lin.qweight is not None:
        q = lin.qweight
        if _fp8_kernel(q):
            return (q.weight.view(torch.uint8), FP8_LIN_TILED_QTYPE if q.cpu_tiles else FP8_LIN_QTYPE,
                    q.out_features, lin.bias, q.scale_inv)
        return _gguf_spec(q, lin.bias)
    p = lin.vnni_packed
    return None if p is None else (p, -1, lin.out_features, lin.bias)


def _add_mlp(stack, mlp: nn.Module) -> bool:
    if type(mlp) is GatedMLP:
        return _set_gated(stack, mlp)
    if type(mlp) is Qwen3MoeBlock:
        gate, experts = mlp.gate, mlp.experts
        if (type(gate) is not SoftmaxTopKRouter or type(experts) is not RoutedExperts or experts._p13 is None
                or not experts.fused_dispatch or any(p.dim() != 4 for p in experts._p13)):
            return False
        stack.set_moe_softmax(gate.weight, gate.top_k, bool(gate.norm_topk_prob), experts._p13, experts._p2,
                              experts.start)
        return True
    if type(mlp) is not DeepseekV3MoE:
        return False
    gate, experts = mlp.gate, mlp.experts
    if (type(gate) is SigmoidGroupRouter and type(experts) is RoutedExperts and experts.q13 is not None
            and gate.weight.dtype == torch.float32 and experts.q13._kernel and experts.q2._kernel):
        # routed experts kept packed on their C++ kernel (e.g. FP8 block-scaled): RoutedExperts.packed_forward's ops
        q13, q2 = experts.q13, experts.q2
        stack.set_moe_packed(gate.weight, gate.e_score_correction_bias, gate.n_group, gate.topk_group, gate.top_k,
                             bool(gate.norm_topk_prob), float(gate.scaling), int(q13.kernel_id), q13.packed,
                             q13.scale, int(getattr(q13, "part_rows", q13.out_features)), q2.packed, q2.scale,
                             int(getattr(q2, "part_rows", q2.out_features)), experts.start, experts.num_experts)
        return mlp.shared_experts is None or (type(mlp.shared_experts) is GatedMLP
                                              and _set_gated(stack, mlp.shared_experts))
    if (type(gate) is not SigmoidGroupRouter or type(experts) is not RoutedExperts or experts._p13 is None
            or not experts.fused_dispatch or gate.weight.dtype != torch.float32):
        return False
    stack.set_moe(gate.weight, gate.e_score_correction_bias, gate.n_group, gate.topk_group, gate.top_k,
                  bool(gate.norm_topk_prob), float(gate.scaling), experts._p13, experts._p2, experts.start)
    return mlp.shared_experts is None or (type(mlp.shared_experts) is GatedMLP and _set_gated(stack, mlp.shared_experts))


def _set_gated(stack, mlp: GatedMLP) -> bool:
    gu, down = mlp.gate_up, mlp.down_proj
    if gu is not None and gu.vnni_packed is not None and down.vnni_packed is not None:
        stack.set_gated_mlp(gu.vnni_packed, gu.bias, gu.out_features, down.vnni_packed, down.bias, down.out_features)
        return True
    specs = [_lin_spec(gu)] if gu is not None else [_lin_spec(mlp.gate_proj), _lin_spec(mlp.up_proj)]
    d = _lin_spec(down)
    if d is None or any(s is None for s in specs) or all(s[1] < 0 for s in specs + [d]):
        return False  # the all-VNNI case is the branch above (a half-packed bf16 MLP keeps the module path)
    stack.set_gated_mlp_lin(specs, d)
    return True
