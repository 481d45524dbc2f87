"""The target's token embedding and LM head as a drafter running on rank 0 alone calls them.

On one device a drafter (the MTP layers, the DSpark drafter) shares the target's own modules: nothing is copied.
Under tensor parallel the target's embedding and LM head are vocab-parallel shards whose forward is a collective
over every rank (``VocabParallelEmbedding`` all-reduces, ``ParallelLMHead`` gathers to rank 0;
tokenfab/parallel/parallel_layers.py), which pairs up only inside a target step the workers run too. A drafter runs
between target steps on rank 0 only (its inputs there, the target's final hidden states and layer taps, are the
full replicated tensors: every decoder layer all-reduces its attention and MLP outputs), so it gets full copies of
those two tables read from the checkpoint on rank 0 (:class:`TargetVocab`).

Extra memory on rank 0: ``vocab_size * hidden_size`` elements of the table's dtype per table a drafter uses (the
embedding, the head; one table when the checkpoint ties them). DeepSeek-V3 (129,280 x 7,168, bf16): 1.85 GB per
table; Kimi K3 (163,840 x 7,168, bf16): 2.35 GB per table. Rank 0's own 1 / N shard of each stays in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.errors import UnsupportedError, WeightLoadError
from tokenfab.layers.linear import matmul_f32

_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_packed", ".qweight")


class TargetVocab:
    """Full copies of the target's embedding [V, H] and LM head [V, H] on rank 0 (see the module docstring).

    Args:
        engine: the target LLMEngine (tensor parallel: ``engine.tp_group`` set; rank 0's model and checkpoint).
        embed / head: load the embedding / the head (a drafter with its own copy of one skips it).

    Attributes:
        embed_weight / head_weight: [V, H] in the dtype of rank 0's shard of that table, on its device (None when
            not loaded; ``head_weight is embed_weight`` when tied).
        nbytes: bytes these copies hold (a tied pair counted once).

    Raises:
        WeightLoadError: a table is missing from the checkpoint, or rank 0's shard is not the checkpoint's rows
            ``plan.vocab[0]`` of it (names both).
        UnsupportedError: the table is stored quantized (a scale or packed companion tensor).
    """

    def __init__(self, engine, embed: bool = True, head: bool = True):
        from tokenfab.loader.safetensors_loader import iterate_weights

        target = engine.runner.model
        prefix = getattr(target.cfg, "weight_prefix", "") or ""
        tied = bool(getattr(target.cfg, "tie_word_embeddings", False))
        e_name, h_name = prefix + "model.embed_tokens.weight", prefix + "lm_head.weight"
        want = ({e_name} if embed or (head and tied) else set()) | ({h_name} if head else set())
        bases = {n[: -len(".weight")] for n in (e_name, h_name)}
        got: dict[str, torch.Tensor] = {}
        path = engine.config.model
        for name, t in iterate_weights(path, progress=False,
                                       want=lambda n: n in want or (n.endswith(_SCALE_SUFFIXES)
                                                                    and n.rsplit(".", 1)[0] in bases)):
            if name not in want:
                raise UnsupportedError(f"speculative decoding under tensor parallel: the checkpoint stores "
                                       f"'{name}', a quantized embedding / LM head; the drafter on rank 0 needs the "
                                       "plain table. Use tensor_parallel_size 1 or method 'ngram' / 'draft_model'.")
            got[name] = t
        if tied and h_name not in got:  # the head is the embedding (as the target's loader ties it)
            want.discard(h_name)
            h_name = e_name
        missing = sorted(want - set(got))
        if missing:
            raise WeightLoadError(f"speculative decoding under tensor parallel: the checkpoint '{path}' has no "
                                  f"{', '.join(missing)} (the drafter on rank 0 reads the full table there).")
        self.embed_weight = self.head_weight = None
        if embed or h_name == e_name:
            self.embed_weight = self._checked(got[e_name], target.model.embed_tokens, e_name)
        if head:
            self.head_weight = (self.embed_weight if h_name == e_name
                                else self._checked(got[h_name], target.lm_head, h_name))
        ts = {id(t): t for t in (self.embed_weight, self.head_weight) if t is not None}
        self.nbytes = sum(t.numel() * t.element_size() for t in ts.values())

    @staticmethod
    def _checked(full: torch.Tensor, shard_module, name: str) -> torch.Tensor:
        """``full`` [V, H] cast to the shard's dtype and device; rank 0's shard must be its rows [v0, v1)."""
        shard = shard_module.weight
        full = full.to(device=shard.device, dtype=shard.dtype).contiguous()
        v0, v1 = shard_module.v0, shard_module.v1
        if full.dim() != 2 or full.shape[1] != shard.shape[1] or not torch.equal(full[v0:v1], shard):
            raise WeightLoadError(f"speculative decoding under tensor parallel: '{name}' {list(full.shape)} in the "
                                  f"checkpoint is not what rank 0's shard (rows {v0}..{v1} of "
                                  f"{list(shard.shape)}) was loaded from.")
        return full

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> [..., H] (the target's embedding rows, no collective)."""
        return F.embedding(input_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 from the float32 accumulator: ``hidden @ lm_head.T`` as the target's
        compute_logits (no collective)."""
        return matmul_f32(hidden.to(self.head_weight.dtype), self.head_weight)
