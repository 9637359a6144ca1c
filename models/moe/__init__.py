"""Mixture-of-experts decoder: the Llama block with routed expert MLPs (``model``) and
top-k routing with capacity (``routing``)."""

from models.moe.model import PRESETS, Moe, MoeConfig

__all__ = ["PRESETS", "Moe", "MoeConfig"]
