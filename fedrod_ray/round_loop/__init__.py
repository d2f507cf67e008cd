"""The round loop, shared by every runtime: ``Federation.step(round)`` (``federation``) and the
evaluation it runs (``evaluation``); it knows executors only by their protocol.
"""
