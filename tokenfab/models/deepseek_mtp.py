"""DeepSeek-V3 / Kimi-K2 next-token-prediction (MTP) layers (``num_nextn_predict_layers`` in config.json), run as a
drafter by :mod:`tokenfab.spec_decode.mtp_proposer`.

Checkpoint layout (DeepSeek-V3 as published): layer i of the MTP stack is ``model.layers.{L + i}.*`` with L =
``num_hidden_layers``: ``enorm``, ``hnorm`` (RMSNorms), ``eh_proj`` [hidden, 2 * hidden], a full decoder block as
layer index L + i would have in the target (MLA attention, then the MoE when L + i >= ``first_k_dense_replace``
and (L + i) % ``moe_layer_freq`` == 0, else the dense MLP), ``shared_head.norm`` and optionally
``shared_head.head`` [vocab, hidden] and ``embed_tokens`` [vocab, hidden]. When the checkpoint omits the head or
the embedding, the target's are used (the DeepSeek-V3 report: embedding and output head shared with the main
model; SGLang always uses the target's, vLLM loads the copies the checkpoint stores: here a stored copy is used).
Under tensor parallel the MTP layers run unsharded on rank 0 (built outside the target's TP context) and the
target's vocab-parallel embedding / head, collectives that pair up only inside a target step, are replaced by full
copies (``vocab``: tokenfab/spec_decode/target_vocab.py) where a layer has no copy of its own.

Forward of layer i at position t (vLLM ``deepseek_mtp.py``, SGLang ``deepseek_nextn.py``)::

    u = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])    # embedding first, then the hidden state
    y = DecoderLayer(u)                                      # attention over this layer's own paged KV, residuals
    logits(t + 2) = head(shared_head.norm(y))

with ``h_t`` the target's final post-norm hidden state at t (what its LM head reads) for the context, or, chaining
drafts, the MTP layer's own output ``y`` at t (before ``shared_head.norm``). vLLM also zeroes the embedding at
position 0; SGLang and the training formulation do not, nor does tokenfab. The block's weights load through
:meth:`CausalLM.load_weights` (expert stacking, shape checks) and get the same fusions (:meth:`CausalLM.post_load`).
In an FP8 block-scaled checkpoint the MTP layer's Linears are FP8 as published (the routed experts kept packed, as
the target's) or unquantized: each layer's routed experts take the format its own tensors are stored in
(:meth:`DeepseekMTP.fp8_experts_in_checkpoint`).
"""
from __future__ import annotations

import copy
import json
import os
import re

import torch
from torch import nn

from tokenfab.errors import EngineConfigError
from tokenfab.layers.attention_metadata import AttentionMetadata
from tokenfab.layers.linear import Linear
from tokenfab.layers.mla import MLAttention
from tokenfab.layers.mlp import GatedMLP
from tokenfab.layers.norm import RMSNorm
from tokenfab.models.base import CausalLM, layer_index
from tokenfab.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from tokenfab.models.llama import DecoderLayer


_FP8_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate|up|down)_proj\.weight_scale_inv$")


class MTPLayer(DecoderLayer):
    """One MTP layer: the decoder block of its layer index plus enorm, hnorm, eh_proj and the shared head's norm
    (and its own head / embedding when the checkpoint has them). Parameter names are the checkpoint's after the
    ``model.layers.{L + i}.`` prefix."""

    def __init__(self, cfg, rotary, moe: bool, own_head: bool, own_embed: bool):
        mlp = DeepseekV3MoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(cfg, MLAttention(cfg, rotary), mlp)
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * H, H)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        if own_head:
            self.shared_head.head = Linear(H, cfg.vocab_size)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.embed_tokens.weight.requires_grad_(False)


class DeepseekMTP(nn.Module):
    """The MTP layers of a DeepSeek-V3 checkpoint, sharing the target's rotary tables, embedding and LM head
    (unless the checkpoint stores its own). Build with :func:`load_mtp`.

    Args:
        target: the loaded :class:`DeepseekV3ForCausalLM` (one device, or rank 0's shard under tensor parallel).
        moe: per MTP layer, whether its block has the MoE.
        own_head / own_embed: per MTP layer, whether the checkpoint stores ``shared_head.head`` / ``embed_tokens``.
        vocab: an object with ``embed(ids)`` / ``logits(hidden)`` used instead of the target's embedding / head by
            layers without their own (tensor parallel: full copies on rank 0), or None (the target's).
    """

    # what CausalLM.load_weights calls besides parameters and modules: the packed-experts preparation (an MTP layer's
    # routed experts follow the checkpoint's compressed-tensors scheme like the target's)
    expert_quantization = CausalLM.expert_quantization
    use_packed_experts = CausalLM.use_packed_experts
    pack_expert_stacks = CausalLM.pack_expert_stacks
    _pack_experts = CausalLM._pack_experts
    unpacked_experts = False
    dequantizes_experts_at_load = False

    def __init__(self, target: DeepseekV3ForCausalLM, moe: list[bool], own_head: list[bool], own_embed: list[bool],
                 vocab=None, fp8_experts: list[bool] | None = None):
        super().__init__()
        self._fp8_experts = fp8_experts if fp8_experts is not None else [True] * len(moe)
        self.cfg = copy.copy(target.cfg)
        self.cfg.tie_word_embeddings = False  # the base loader must not tie a head this module does not have
        self.tp = None
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(MTPLayer(self.cfg, target.rotary, m, h, e)
                                          for m, h, e in zip(moe, own_head, own_embed))
        self.model.embed_tokens = None  # the target's (not a submodule: not loaded, not moved)
        self.lm_head = None
        self._target = (target,)  # a tuple keeps it out of this module's parameters
        self._vocab = (vocab,)

    def fp8_experts_in_checkpoint(self, name: str) -> bool:
        """Whether MTP layer ``model.layers.{i}.mlp.experts``'s routed experts are stored FP8 (``fp8_experts[i]``):
        an FP8 checkpoint may ship its MTP layer FP8 (DeepSeek-V3 as published) or unquantized."""
        i = layer_index(name)
        return i is None or self._fp8_experts[i]

    def is_skipped_weight(self, name: str) -> bool:
        """As the target skips them: rotary caches, and DeepSeek's zero-width shared MLP at n_shared_experts 0."""
        if not self.cfg.n_shared_experts and ".mlp.shared_experts." in name:
            return True
        return name.endswith("rotary_emb.inv_freq")

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> list:
        """One MLA latent pool [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] per MTP layer."""
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
        return [torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device) for _ in self.model.layers]

    def embed(self, i: int, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]: layer i's embedding (its own, else the target's)."""
        layer = self.model.layers[i]
        emb = getattr(layer, "embed_tokens", None)
        if emb is None and self._vocab[0] is not None:
            return self._vocab[0].embed(input_ids)
        return (emb if emb is not None else self._target[0].model.embed_tokens)(input_ids)

    def forward(self, i: int, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """MTP layer ``i`` on a flat batch: ``input_ids`` [T] int64 (the token after each position), ``positions``
        [T] int64, ``prev_hidden`` [T, hidden] (target final hidden states or this layer's previous outputs),
        ``cache`` layer i's pool (K/V written at ``meta.slot_mapping``). Returns the block's output [T, hidden]
        (before ``shared_head.norm``)."""
        layer = self.model.layers[i]
        e = layer.enorm(self.embed(i, input_ids))
        u = layer.eh_proj(torch.cat([e, layer.hnorm(prev_hidden.to(e.dtype))], dim=-1))
        return DecoderLayer.forward(layer, positions, u, cache, meta)

    def compute_logits(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] layer-i outputs -> [N, vocab] float32: ``head(shared_head.norm(hidden))`` with layer i's own
        head, else the target's LM head."""
        sh = self.model.layers[i].shared_head
        x = sh.norm(hidden)
        head = getattr(sh, "head", None)
        if head is None and self._vocab[0] is not None:
            return self._vocab[0].logits(x)
        return head.forward_f32(x) if head is not None else self._target[0].compute_logits(x)


def mtp_layer_names(path: str, num_hidden_layers: int, n: int) -> dict[int, set[str]]:
    """{MTP layer i: names after ``model.layers.{L + i}.``} of the tensors a checkpoint folder stores (header reads
    only)."""
    from safetensors import safe_open

    from tokenfab.loader.safetensors_loader import checkpoint_files
    out: dict[int, set[str]] = {i: set() for i in range(n)}
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                idx = layer_index(name)
                if idx is not None and num_hidden_layers <= idx < num_hidden_layers + n:
                    out[idx - num_hidden_layers].add(name.split(".", 3)[3])
    return out


@torch.no_grad()
def load_mtp(path: str, target, device: torch.device, dtype: torch.dtype, vocab=None) -> DeepseekMTP:
    """Build the MTP layers of the checkpoint folder ``path`` for ``target`` and load their weights.

    ``vocab(embed: bool, head: bool)``: called under tensor parallel (``target.tp`` set) when some layer lacks its
    own embedding / head, returns the full copies those layers use instead of the target's shards (see
    :class:`DeepseekMTP`); the layers themselves are built unsharded.

    Raises:
        EngineConfigError: ``target`` is not a DeepSeek-V3 / Kimi-K2 model, or the checkpoint has no MTP layers
            (``num_nextn_predict_layers`` 0, or config.json names some but no ``model.layers.{L}.*`` tensor exists;
            published DeepSeek-V3 / R1 checkpoints have one), or a layer lacks enorm / hnorm / eh_proj /
            shared_head.norm, or a tensor-parallel target without ``vocab`` where a layer needs the target's.
        WeightLoadError: a block weight is missing, unexpected or misshapen (named).
    """
    from tokenfab.loader.safetensors_loader import iterate_weights

    if not isinstance(target, DeepseekV3ForCausalLM):
        raise EngineConfigError(f"speculative_config.method 'mtp' needs a DeepSeek-V3 / Kimi-K2 checkpoint with "
                                f"next-token-prediction layers; the model is {type(target).__name__}. Use 'ngram' "
                                "or 'draft_model'.")
    if not os.path.isdir(path):
        raise EngineConfigError(f"speculative_config.method 'mtp' reads the MTP layers from a checkpoint folder; "
                                f"'{path}' is not one. Use 'ngram' or 'draft_model'.")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw = raw.get("text_config", raw)
    L = int(raw["num_hidden_layers"])
    n = int(raw.get("num_nextn_predict_layers") or 0)
    names = mtp_layer_names(path, L, n) if n else {}
    if not n or not any(names.values()):
        raise EngineConfigError(
            f"speculative_config.method 'mtp': the checkpoint '{path}' has no next-token-prediction layers "
            f"(config.json num_nextn_predict_layers {n}; no model.layers.{L}.* tensors). Use a checkpoint that ships "
            "them (DeepSeek-V3 / R1 do) or speculative_config method 'ngram' / 'draft_model'.")
    need = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    for i in range(n):
        lack = [x for x in need if x not in names[i]]
        if lack:
            raise EngineConfigError(f"speculative_config.method 'mtp': MTP layer model.layers.{L + i} in '{path}' "
                                    f"lacks {', '.join(lack)}; the checkpoint is not in DeepSeek-V3's MTP layout.")
    k_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    has_experts = bool(target.cfg.num_experts)
    moe = [has_experts and L + i >= k_dense and (L + i) % freq == 0 for i in range(n)]
    own_head = ["shared_head.head.weight" in names[i] for i in range(n)]
    own_embed = ["embed_tokens.weight" in names[i] for i in range(n)]
    # an FP8 checkpoint's MTP layer: routed experts FP8 as published (weight_scale_inv pairs, kept packed) or
    # unquantized (per expert or stacked: bf16 stacks); each layer's own tensors decide
    fp8_experts = [any(_FP8_EXPERT.match(x) for x in names[i]) for i in range(n)]
    full = None
    if target.tp is not None and not (all(own_head) and all(own_embed)):  # the target's tables are shards
        if vocab is None:
            raise EngineConfigError("speculative_config.method 'mtp' on a tensor-parallel target needs full copies "
                                    "of the target's embedding / LM head (load_mtp's vocab).")
        full = vocab(not all(own_embed), not all(own_head))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        mtp = DeepseekMTP(target, moe, own_head, own_embed, full, fp8_experts).requires_grad_(False)
    finally:
        torch.set_default_dtype(prev)

    def is_mtp(name: str) -> bool:
        idx = layer_index(name)
        return idx is not None and L <= idx < L + n

    def renamed():  # model.layers.{L + i}.X -> model.layers.{i}.X (only those tensors are read)
        for name, t in iterate_weights(path, progress=False, want=is_mtp):
            yield f"model.layers.{layer_index(name) - L}.{name.split('.', 3)[3]}", t

    weights = renamed()
    if getattr(target.cfg, "fp8_block_size", None) is not None:  # FP8 block-scaled: pairs kept packed, as the target
        from tokenfab.loader.fp8_block_loader import Fp8CheckpointWeights
        weights = Fp8CheckpointWeights(weights)
    CausalLM.load_weights(mtp, weights)  # the base loader: needs cfg, tp, parameters, modules only
    mtp.to(device).eval()
    CausalLM.post_load(mtp)  # fusions: absorbed MLA weights, gate|up, packed CPU linears, expert packing
    return mtp
