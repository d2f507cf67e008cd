"""The client side: ``ClientHost``, which trains and evaluates clients whose state comes with each call
(``client``), the Ray actors that wrap it (``actors``) and their test-only fault hook (``faults``).
"""
