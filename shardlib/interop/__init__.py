"""Other tools' formats: Hugging Face checkpoints (``hf``, ``hf_io``), DeepSpeed configs
(``deepspeed``) and export of a checkpoint's parameters (``export``)."""
