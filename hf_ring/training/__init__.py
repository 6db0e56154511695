"""The recipe runner and what it needs around ``RingTrainer``: recipe parsing (``recipe``), data
through the ``datasets`` library (``data``), the final adapter or model (``export``), passkey
evaluation (``evaluate``), plots (``plots``), start-up checks (``checks``) and the TRL mixin
(``trl``). ``recipes/train.py`` calls ``hf_ring.training.run.main``.
"""
