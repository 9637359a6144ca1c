"""GPT decoder as published (GPT-2, GPT-3): the model (``model``), Brown et al.'s presets
(``presets``) and its Hugging Face GPT-2 names and layouts (``hf``)."""

from models.gpt.model import GPT, GPTConfig
from models.gpt.presets import PRESETS, preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset"]
