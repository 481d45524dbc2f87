"""Routed-token counts per MoE layer per expert, recorded while serving (a calibration run) and written as the JSON
that ``--expert-popularity FILE`` reads (tokenfab/planner/expert_placement.py) to keep the most used experts on
the devices.

File format::

    {"format": "tokenfab-expert-popularity", "version": 1, "num_experts": E, "tokens": N,
     "layers": {"<decoder layer index>": [pairs routed to expert 0, ..., expert E-1], ...}}

A "pair" is one (token, slot) routing choice, so each layer's counts sum to tokens x top-k. Every forward pass
counts, prefill chunks included. Under tensor parallel the router is replicated, so rank 0 sees every choice and
is the one that records.
"""
from __future__ import annotations

import json
import os

import torch


class RouteCounter:
    """Counts for one MoE layer; ``record(ids)`` adds ``bincount(ids)`` (ids [T, k] global expert ids)."""

    def __init__(self, num_experts: int, owner: "ExpertPopularity"):
        self.counts = torch.zeros(num_experts, dtype=torch.int64)
        self.owner = owner
        self.first = False

    def record(self, ids: torch.Tensor) -> None:
        self.counts += torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts.numel())
        if self.first:
            self.owner.tokens += ids.shape[0]


class ExpertPopularity:
    """Routed-pair counters attached to every MoE layer of a model (``RoutedExperts.route_counter``)."""

    def __init__(self, model):
        from tokenfab.layers.host_experts import moe_expert_modules
        self.tokens = 0
        self.layers: dict[int, RouteCounter] = {}
        mods = moe_expert_modules(model)
        for i, m in mods.items():
            c = RouteCounter(m.num_experts, self)
            c.first = i == min(mods)
            m.route_counter = c
            self.layers[i] = c
        self.num_experts = next(iter(mods.values())).num_experts if mods else 0

    def to_dict(self) -> dict:
        """The file's content (see the module docstring)."""
        return {"format": "tokenfab-expert-popularity", "version": 1, "num_experts": self.num_experts,
                "tokens": self.tokens, "layers": {str(i): c.counts.tolist() for i, c in sorted(self.layers.items())}}

    def write(self, path: str) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (atomically: a temporary file renamed over it)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)
