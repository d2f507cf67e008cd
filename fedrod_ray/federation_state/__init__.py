"""The federation's state: what a run derives from its config (``setup``), what it has learned
(``state``), its checkpoints (``checkpoint``), the per-round state of DP and FedBuff (``dp_rounds``,
``buffered_rounds``) and the served ``final/`` (``final``).
"""
