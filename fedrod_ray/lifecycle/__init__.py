"""One run's lifecycle: ``Run``, which owns a federation and its run directory (``run``), and the
coordinator actor that holds a Ray run's ``Run`` on the cluster (``coordinator``).
"""
