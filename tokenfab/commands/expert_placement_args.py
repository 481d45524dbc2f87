"""The routed-expert placement flags `tokenfab serve` and `tokenfab plan` share (one definition, one wording).

``--host-experts`` (a share such as 50% or a count per MoE layer), ``--num-device-experts`` (its complement) and
``--expert-popularity`` (routed-token counts that decide which experts stay on the devices). Their values are
checked where they are used (tokenfab/planner/expert_placement.py), so both commands refuse the same inputs with the
same message.
"""
from __future__ import annotations

import argparse


def add_expert_placement_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, planning: bool) -> None:
    """Add the three placement flags to ``p``; ``planning`` (tokenfab plan) words them as implying
    --offload-experts instead of naming the serving side's host-expert worker."""
    where = ("Implies --offload-experts. " if planning else
             "The host computes its experts on its CPUs, overlapped with the device's (tokenfab/layers/"
             "host_experts.py); `tokenfab plan ... --offload-experts` says what fits. ")
    p.add_argument("--host-experts", default=None,
                   help="Keep this share (e.g. 50%%) or count of each MoE layer's routed experts in host memory. "
                        + where + "Default: none.")
    p.add_argument("--num-device-experts", type=int, default=None,
                   help="Instead of --host-experts: routed experts per MoE layer kept on the devices (all ranks "
                        "together); the rest go to host memory." + (" Implies --offload-experts." if planning else ""))
    p.add_argument("--expert-popularity", default=None, metavar="FILE",
                   help="Routed-token counts per layer per expert (JSON from tokenfab serve "
                        "--record-expert-popularity): the most used experts stay on the devices."
                        + ("" if planning else " Needs --host-experts or --num-device-experts."))
