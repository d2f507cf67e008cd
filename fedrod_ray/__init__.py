"""fedrod-ray: Fed-RoD (Federated Robust Decoupling, ICLR 2022) on Ray.

A shared feature extractor with a generic head trained by a balanced loss (for the server's generic
model) and a personalized head per client (for each client's own model), trained in-process or by Ray
actors.
"""

__version__ = "0.3.0"
