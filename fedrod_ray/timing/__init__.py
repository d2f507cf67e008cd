"""When things happen, as pure state machines: the virtual clock of clients' devices (``clock``) and
the Ray executor's dispatch policies (``scheduling``).
"""
