"""The drivers of a run: in-process (``runner``), on Ray (``ray_runtime``), and what they print
(``console``).
"""
