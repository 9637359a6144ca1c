"""GLaM (Du et al. 2021): experts in every other layer, top-2 gating with GShard's balancing
loss, GEGLU dense MLPs and GELU experts (``model``); the paper's shapes (``presets``)."""

from models.glam.model import Glam, GlamConfig
from models.glam.presets import PRESETS

__all__ = ["PRESETS", "Glam", "GlamConfig"]
