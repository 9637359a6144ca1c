"""Checkpoints: orbax storage (``store``), the asynchronous writer (``saver``), one run per
directory (``dirlock``), and the training loop's resume/save schedule (``resume``)."""
