"""The server's math, pure functions on state dicts: sample-count-weighted averaging (``aggregate``),
which clients train in a round (``server``), FedBuff's buffered asynchronous steps (``buffered``),
client-level differential privacy (``privacy``) and its accountant (``accounting``).
"""
