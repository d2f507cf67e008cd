"""fedrod-ray: Fed-RoD (Federated Robust Decoupling, ICLR 2022) on Ray.

A shared feature extractor with a generic head trained by a balanced loss (for the server's generic
model) and a personalized head per client (for each client's own model), trained in-process or by Ray
actors.

Layers, bottom to top. A module imports only from its own layer and those below it, and no import
circle exists (tests/test_layering.py reads this list and checks every import of every module):

1. base: config, specs, plugins, storage, aggregate, scheduling, server, clock, buffered, losses, metric_schema, plotting, results, tracking, faults, privacy, accounting
2. pieces: data, models, partition, metrics, algorithms, export
3. local math: step, objectives, local, batched, personalization
4. clients: client, actors
5. federation state: setup, client_store, state, checkpoint, dp_rounds, buffered_rounds, final
6. executors and evaluation: executors, evaluation
7. round loop: federation
8. a run: run, coordinator
9. drivers: console, runner, ray_runtime
10. command line: cli

A package (data, models, algorithms, objectives, personalization, executors) stands for all its modules. The HTTP service (``api/``)
imports only the first two layers; ``api/`` and ``tune/`` import the library, never the other way round.
"""

__version__ = "0.3.0"
