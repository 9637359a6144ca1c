"""Llama-style decoder: the model (``model``), its presets (``presets``), its KV cache for
generation (``cache``), LoRA adapters (``lora``), its Hugging Face names and layouts
(``hf``), and the layers it is built from (``norm``, ``rotary``)."""

from models.llama.model import Llama, LlamaConfig
from models.llama.presets import PRESETS, preset

__all__ = ["PRESETS", "Llama", "LlamaConfig", "preset"]
