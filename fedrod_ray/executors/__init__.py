"""Executors: what runs a round's client calls for the round loop.

``base`` holds the protocol the round loop (``fedrod_ray.round_loop.federation``) drives, and the only module
of this package it imports; ``in_process`` trains the clients one after another in this process,
``batched`` several at once in one batched pass, and ``ray`` sends the calls to client actors. Nothing
is imported here, so that the round loop's import of ``base`` loads no executor (and no Ray).
"""
