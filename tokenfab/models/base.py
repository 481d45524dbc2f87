"""What every causal LM in tokenfab shares: embedding, decoder stack, final norm, lm_head, weight loading.

Module and parameter names mirror the Hugging Face checkpoints (``model.layers.{i}.self_attn.q_proj.weight``...),
so most weights load by name. Routed experts are stacked per layer (``mlp.experts.w13`` / ``mlp.experts.w2``) and
filled from the per-expert checkpoint names (``mlp.experts.{e}.{gate,up,down}_proj.weight``) or from transformers
5's fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenfab.config import ModelConfig
from tokenfab.errors import WeightLoadError
from tokenfab.layers.attention_metadata import AttentionMetadata
from tokenfab.kernels import dispatch
from tokenfab.kernels.cpu.ops import vnni_linear as cpu_vnni
from tokenfab.layers.linear import Linear, cpu_linear_backend, matmul_f32, pack_weight, packed_linear_f32
from tokenfab.layers.moe import RoutedExperts
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.packed_embedding import PackedEmbedding
from tokenfab.parallel.distributed import current_tp
from tokenfab.parallel.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from tokenfab.quant.packed_weight import PackedWeight

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PACKED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                            r"(weight_packed|weight_scale|weight_shape)$")
_FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CausalLM(nn.Module):
    """Base class. Subclasses build ``self.model.layers`` (decoder layers with ``forward(positions, x, cache,
    meta)``) and implement :meth:`make_kv_cache`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.tp = current_tp()  # None on one device; else vocab-parallel embedding and lm_head
        if self.tp is None:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.model.embed_tokens.weight.requires_grad_(False)
        else:
            self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.model.layers = nn.ModuleList()
        self.model.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if self.tp is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden] (after the last norm)."""
        h = self.model.embed_tokens(input_ids)
        residual = None  # GPU path: the layer output is h + residual, the add left to the next fused add + norm
        for layer, cache in zip(self.model.layers, kv_caches):
            if getattr(layer, "splits_residual", False) and dispatch.gpu_path(h):
                h, residual = layer(positions, h, cache, meta, residual=residual, split_residual=True)
                continue
            if residual is not None:
                h, residual = h + residual, None
            h = layer(positions, h, cache, meta)
        if residual is not None:
            return self.model.norm(h, residual)[0]
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 straight from the LM head's float32 accumulator (never
        rounded to bf16, so rounding cannot make two tokens tie: DESIGN.md), on every path: a compressed head
        (GGUF), tokenfab's VNNI-packed head, or :func:`~tokenfab.layers.linear.matmul_f32` (oneDNN / torch
        backends, float32 models, GPUs). Under tensor parallel: on rank 0; other ranks get an empty tensor."""
        qweight = getattr(self, "_lm_head_qweight", None)  # a compressed head (GGUF), see load_weights
        if qweight is not None:
            return qweight.linear_f32(hidden)
        packed = getattr(self, "_lm_head_packed", None)
        if packed is not None:
            return packed_linear_f32(hidden, packed, self._lm_head_rows)
        if isinstance(self.lm_head, nn.Linear):
            return matmul_f32(hidden, self.lm_head.weight)
        return self.lm_head(hidden)  # ParallelLMHead: float32 local logits gathered to rank 0

    def make_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> list:
        """Allocate the paged KV pool, one entry per layer."""
        raise NotImplementedError

    # ---- loading -------------------------------------------------------------------------------------------
    def is_skipped_weight(self, name: str) -> bool:
        """Checkpoint tensors we deliberately do not load (e.g. MTP layers); see subclasses."""
        return name.endswith("rotary_emb.inv_freq")

    def expert_quantization(self):
        """The checkpoint's compressed-tensors scheme (:class:`~tokenfab.quant.compressed_tensors.
        CompressedTensorsScheme`) from config.json's ``quantization_config``, or None when it has none or another
        quant_method (e.g. fp8, read by its own loader).

        Raises:
            ConfigError: a compressed-tensors field tokenfab does not run (named).
        """
        qc = (self.cfg.raw or {}).get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
            return None
        from tokenfab.quant.compressed_tensors import parse_compressed_tensors
        return parse_compressed_tensors(qc)

    unpacked_experts = False  # set before load_weights when host experts are requested (engine/model_loader.py)
    gguf_expert_stacks: frozenset = frozenset()  # RoutedExperts module names a GGUF file stores quantized (its loader)
    dequantizes_experts_at_load = False  # a model whose loader can dequantize its packed experts instead

    def use_packed_experts(self) -> None:
        """Before loading: every RoutedExperts whose expert Linears the checkpoint's scheme quantizes (targeted,
        not in ``ignore``) keeps them packed (:meth:`RoutedExperts.use_packed`); ignored ones stay bf16.

        With ``unpacked_experts`` (host experts requested) a model that ``dequantizes_experts_at_load`` (Kimi's
        MXFP4) loads them dequantized instead, as the host/device split needs.

        An FP8 block-scaled checkpoint (``cfg.fp8_block_size``, DeepSeek-V3 / Kimi-K2 as published: every routed
        expert Linear FP8) keeps every layer's routed experts packed (tokenfab/quant/fp8_block_experts.py), or with
        ``unpacked_experts`` dequantizes them into the bf16 stacks as they load.

        Raises:
            WeightLoadError: a layer whose experts are partly ignored (one format per layer's stack).
            UnsupportedError: host experts requested for packed experts this model cannot dequantize at load.
        """
        self.pack_expert_stacks()
        for m in self.modules():  # built on the meta device (moe.deferred_expert_storage) and not packed
            if isinstance(m, RoutedExperts):
                m.materialize()

    def pack_expert_stacks(self) -> None:
        """The packing half of :meth:`use_packed_experts`: the RoutedExperts the checkpoint stores packed get their
        :class:`~tokenfab.quant.packed_experts.PackedExperts` stacks (on the default device: ``load_format="dummy"``
        builds them on the meta device and fills them on the target device, loader/dummy_packed.py); the others are
        left as built. Raises as :meth:`use_packed_experts`."""
        scheme = self.expert_quantization()
        if scheme is not None:
            self._pack_experts(scheme)
        elif getattr(self, "gguf_expert_stacks", ()) and not self.unpacked_experts:  # a GGUF file's quantized
            for name, mod in self.named_modules():                                   # expert stacks (MTP: none)
                if isinstance(mod, RoutedExperts) and name in self.gguf_expert_stacks and mod.q13 is None:
                    mod.use_packed("gguf")
        elif getattr(self.cfg, "fp8_block_size", None) is not None and not self.unpacked_experts:
            for name, mod in self.named_modules():  # FP8 block-scaled (DeepSeek-V3 / Kimi-K2): routed experts FP8
                if (isinstance(mod, RoutedExperts) and mod.q13 is None and mod.w13 is not None
                        and self.fp8_experts_in_checkpoint(name)):
                    mod.use_packed("fp8_block")  # host experts requested: dequantized by load_weights instead

    def fp8_experts_in_checkpoint(self, name: str) -> bool:
        """In an FP8 block-scaled checkpoint, whether the routed experts of module ``name`` are stored FP8 (kept
        packed) rather than unquantized (loaded into bf16 stacks). True for every layer of a published model; a
        drafter whose layers may be stored either way (models/deepseek_mtp.py) answers per layer."""
        return True

    def _pack_experts(self, scheme) -> None:
        if self.unpacked_experts:  # host experts requested: the host/device split moves bf16 stacks only
            if self.dequantizes_experts_at_load:
                return
            from tokenfab.errors import UnsupportedError
            raise UnsupportedError(f"host experts (host_experts / --host-experts, num_device_experts) need bf16 "
                                   f"routed experts, and this checkpoint's are {scheme.format} (kept packed); leave "
                                   "them unset for this checkpoint.")
        for name, mod in self.named_modules():
            if not isinstance(mod, RoutedExperts) or mod.q13 is not None or mod.w13 is None:
                continue
            quantized = {scheme.quantizes(f"{name}.{e}.{p}") for e in range(mod.start, mod.end)
                         for p in ("gate_proj", "up_proj", "down_proj")}
            if quantized == {True, False}:
                raise WeightLoadError(f"{name}: quantization_config.ignore names some of this layer's routed expert "
                                      "Linears but not all; tokenfab keeps a layer's experts in one format (ignore "
                                      "all of them or none).")
            if quantized == {True}:
                mod.use_packed(scheme.format)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy checkpoint tensors into parameters by name.

        A value may be a :class:`~tokenfab.quant.packed_weight.PackedWeight` (a compressed checkpoint) for a
        Linear's ``weight``: the Linear keeps it (``Linear.set_qweight``) instead of a plain copy. For
        ``model.embed_tokens.weight`` the embedding becomes a :class:`~tokenfab.layers.packed_embedding.
        PackedEmbedding` over it (and a tied LM head multiplies the same packed weight); for ``lm_head.weight`` the
        head multiplies it (``_lm_head_qweight``).

        Returns the names skipped on purpose. Raises WeightLoadError listing missing weights, unexpected weights
        and shape mismatches.
        """
        self.use_packed_experts()
        params = dict(self.named_parameters())
        linears = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        expert_mods = {n: m for n, m in self.named_modules() if isinstance(m, RoutedExperts)}
        loaded: set[str] = set()
        expert_loaded: dict[str, set] = {n: set() for n in expert_mods}
        unexpected, skipped, bad_shape, bad_dtype, packed_elsewhere = [], [], [], [], []
        refused_stacks: set[str] = set()  # RoutedExperts prefixes whose unquantized stacks were refused
        file_of = getattr(weights, "file_of", None)  # CheckpointWeights names each tensor's file

        def where(name: str) -> str:
            f = file_of(name) if file_of is not None else None
            return f"{name} (in {f})" if f else name

        for name, t in weights:
            if self.is_skipped_weight(name):
                skipped.append(name)
                continue
            m = _PACKED_EXPERT.match(name)
            if m and m.group(1) in expert_mods:  # a routed expert kept packed (tokenfab/quant/packed_experts.py)
                mod, e, proj, part = expert_mods[m.group(1)], int(m.group(2)), m.group(3), m.group(4)
                if mod.q13 is None:
                    bad_dtype.append(f"{where(name)}: a packed (quantized) expert tensor, but config.json's "
                                     "quantization_config does not quantize this layer's experts (absent or "
                                     "in its ignore list)")
                    continue
                if mod.start <= e < mod.end:
                    q, row0 = (mod.q2, 0) if proj == "down_proj" else (mod.q13, mod.intermediate * (proj == "up_proj"))
                    try:
                        q.load_part(e - mod.start, row0, part, t, where(name))
                    except WeightLoadError as err:
                        bad_shape.append(str(err))
                        continue
                if part != "weight_shape":
                    expert_loaded[m.group(1)].add((e, proj, part))
                continue
            m = _EXPERT.match(name)
            if m and m.group(1) in expert_mods and isinstance(t, PackedWeight):  # FP8 expert Linear (paired)
                mod, e, proj = expert_mods[m.group(1)], int(m.group(2)), m.group(3)
                if mod.q13 is not None:
                    if mod.start <= e < mod.end:
                        q, row0 = ((mod.q2, 0) if proj == "down_proj"
                                   else (mod.q13, mod.intermediate * (proj == "up_proj")))
                        try:
                            q.load_part(e - mod.start, row0, "weight", t, where(name))
                        except WeightLoadError as err:
                            bad_shape.append(str(err))
                            continue
                    expert_loaded[m.group(1)].add((e, proj, "weight"))
                    continue
                t = t.dequantize()  # bf16 stacks (host experts): the published formula in float32, one rounding
            if m and m.group(1) in expert_mods:
                mod, e, proj = expert_mods[m.group(1)], int(m.group(2)), m.group(3)
                if mod.q13 is not None:
                    bad_dtype.append(f"{where(name)}: an unquantized expert weight, but config.json's "
                                     f"quantization_config quantizes this layer's experts ({mod.q13.format_name}: "
                                     f"{' / '.join(mod.q13.checkpoint_parts)} expected; for compressed-tensors, "
                                     "list them in its ignore to load them unquantized)")
                    continue
                if mod.start <= e < mod.end:
                    I = mod.intermediate
                    dst = {"gate_proj": mod.w13[e - mod.start, :I], "up_proj": mod.w13[e - mod.start, I:],
                           "down_proj": mod.w2[e - mod.start]}[proj]
                    if dst.shape != t.shape:
                        bad_shape.append(f"{where(name)}: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}")
                        continue
                    dst.copy_(t)
                expert_loaded[m.group(1)].add((e, proj))
                continue
            m = _FUSED_EXPERT.match(name)
            if m and m.group(1) in expert_mods:
                mod = expert_mods[m.group(1)]
                if mod.q13 is not None:
                    bad_dtype.append(f"{where(name)}: an unquantized expert stack, but config.json's "
                                     "quantization_config quantizes this layer's experts")
                    refused_stacks.add(m.group(1))  # its experts are present, in the wrong format: not missing
                    continue
                dst = mod.w13 if m.group(2) == "gate_up_proj" else mod.w2
                src = t[mod.start:mod.end] if t.shape[0] == mod.num_experts else t  # else: already this rank's slice
                if dst.shape != src.shape:
                    bad_shape.append(f"{where(name)}: checkpoint {tuple(src.shape)} vs model {tuple(dst.shape)}")
                    continue
                dst.copy_(src)
                projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
                expert_loaded[m.group(1)].update((e, p) for e in range(mod.start, mod.end) for p in projs)
                continue
            if isinstance(t, PackedWeight) and name in ("model.embed_tokens.weight", "lm_head.weight"):
                head = name == "lm_head.weight"
                mod = self.lm_head if head else self.model.embed_tokens
                want = (self.cfg.vocab_size, self.cfg.hidden_size)
                if self.tp is not None or type(mod) is not (nn.Linear if head else nn.Embedding):
                    unexpected.append(name)
                elif (t.out_features, t.in_features) != want:
                    bad_shape.append(f"{name}: checkpoint {(t.out_features, t.in_features)} vs model {want}")
                elif head:
                    self.lm_head.weight = None
                    self._lm_head_qweight = t
                    loaded.add(name)
                else:
                    self.model.embed_tokens = PackedEmbedding(t, mod.weight.dtype)
                    loaded.add(name)
                continue
            if isinstance(t, PackedWeight):
                lin = linears.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
                if lin is None or name not in params:
                    unexpected.append(name)
                elif (t.out_features, t.in_features) != (lin.out_features, lin.in_features):
                    bad_shape.append(f"{name}: checkpoint {(t.out_features, t.in_features)} vs model "
                                     f"{(lin.out_features, lin.in_features)}")
                else:
                    lin.set_qweight(t)
                    loaded.add(name)
                continue
            p = params.get(name)
            if p is None and name.endswith((".weight_packed", ".weight_scale", ".weight_shape")):
                packed_elsewhere.append(name)
                continue
            if p is None:
                unexpected.append(name)
                continue
            if p.shape != t.shape:
                bad_shape.append(f"{where(name)}: checkpoint {tuple(t.shape)} vs model {tuple(p.shape)}")
                continue
            if p.is_floating_point() and not t.is_floating_point():  # copy_ would cast integers silently
                bad_dtype.append(f"{where(name)}: checkpoint dtype {str(t.dtype).removeprefix('torch.')}, expected "
                                 "a floating-point tensor (bf16, fp16 or fp32)")
                continue
            p.copy_(t)
            loaded.add(name)
        if self.cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
            if isinstance(self.model.embed_tokens, PackedEmbedding):  # the head multiplies the packed table
                self.lm_head.weight = None
                self._lm_head_qweight = self.model.embed_tokens.qweight
            else:
                self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = [n for n in params if n not in loaded and not any(n.startswith(e + ".") for e in expert_mods)]
        for prefix, mod in expert_mods.items():
            if mod.q13 is not None:
                need = {(e, p, part) for e in range(mod.start, mod.end) for p in ("gate_proj", "up_proj", "down_proj")
                        for part in mod.q13.checkpoint_parts}
                missing += [f"{prefix}.{e}.{p}.{part}" for e, p, part in sorted(need - expert_loaded[prefix])]
                continue
            need = {(e, p) for e in range(mod.start, mod.end) for p in ("gate_proj", "up_proj", "down_proj")}
            missing += [f"{prefix}.{e}.{p}.weight" for e, p in sorted(need - expert_loaded[prefix])]
        misfit = {e.split(" ", 1)[0].rstrip(":") for e in bad_shape + bad_dtype}  # present, reported below
        missing = [n for n in missing if n not in misfit and not any(n.startswith(p + ".") for p in refused_stacks)]
        problems = []
        if packed_elsewhere:
            problems.append(f"packed (quantized) tensors outside the routed experts ({len(packed_elsewhere)}): "
                            + ", ".join(packed_elsewhere[:10]) + (" ..." if len(packed_elsewhere) > 10 else "")
                            + "; tokenfab runs compressed-tensors int4 / MXFP4 for routed experts only (the "
                            "checkpoint's quantization_config.ignore must list the other Linears)")
        if missing:
            problems.append(f"missing weights ({len(missing)}): {', '.join(missing[:20])}"
                            + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            problems.append(f"unexpected weights ({len(unexpected)}): {', '.join(unexpected[:20])}"
                            + (" ..." if len(unexpected) > 20 else ""))
        if bad_shape:
            problems.append(f"shape mismatches ({len(bad_shape)}; the model's shapes come from config.json): "
                            + "; ".join(bad_shape[:10]) + (" ..." if len(bad_shape) > 10 else ""))
        if bad_dtype:
            problems.append(f"wrong dtypes ({len(bad_dtype)}): " + "; ".join(bad_dtype[:10])
                            + (" ..." if len(bad_dtype) > 10 else ""))
        if problems:
            raise WeightLoadError("checkpoint does not match the model: " + " | ".join(problems))
        return skipped

    def post_load(self) -> None:
        """Run once the weights are in and on their device: fusions and derived tensors (absorbed MLA weights,
        gate|up concatenation, packed CPU bf16 linears)."""
        for m in list(self.modules()):  # fuse() may add submodules
            if hasattr(m, "fuse") and callable(m.fuse):
                m.fuse()
        if isinstance(self.model.embed_tokens, PackedEmbedding):
            self.model.embed_tokens.qweight.prepare()
        if getattr(self, "_lm_head_qweight", None) is not None:
            self._lm_head_qweight.prepare()
        CausalLM.pack_lm_head(self)  # also for modules that borrow post_load (models/deepseek_mtp.py)

    def pack_lm_head(self) -> None:
        """Give the LM head, tied or not, tokenfab's VNNI-packed copy when that kernel runs here (CPU bf16 with
        AVX512-BF16, ``TOKENFAB_CPU_LINEAR=tokenfab``), so :meth:`compute_logits` and the fused decode stack store its
        float32 accumulator as the logits. An untied head's plain weight is freed; a tied one stays the embedding's
        (the packed copy costs vocab x hidden bf16 more memory). Other backends keep the plain weight, which
        :func:`~tokenfab.layers.linear.matmul_f32` multiplies in float32 (oneDNN's packed layout has no float32
        output). No-op when a packed head exists."""
        lm = self.lm_head
        if (getattr(self, "_lm_head_packed", None) is None and isinstance(lm, nn.Linear) and lm.weight is not None
                and cpu_linear_backend() == "tokenfab" and cpu_vnni.vnni_linear_applies(lm.weight)):
            self._lm_head_packed, self._lm_head_rows = pack_weight(lm.weight), lm.weight.shape[0]
            if not self.cfg.tie_word_embeddings:
                lm.weight = None


def layer_index(name: str) -> int | None:
    """Decoder layer index named in a checkpoint key, or None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None
