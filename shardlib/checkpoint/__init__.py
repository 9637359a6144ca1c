"""Checkpoints: orbax storage (``store``), the asynchronous writer (``saver``), one run per
directory (``dirlock``), the fast-restart tier and the fallback past damaged steps
(``tiers``), and the training loop's resume/save schedule (``resume``)."""
