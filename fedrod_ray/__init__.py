"""fedrod-ray: Fed-RoD (Federated Robust Decoupling, ICLR 2022) on Ray.

A shared feature extractor with a generic head trained by a balanced loss (for the server's generic
model) and a personalized head per client (for each client's own model), trained in-process or by Ray
actors.

Layers, bottom to top: folders (subpackages), and the command line's module. A module imports only from its
own layer and those below it, and no import circle exists (tests/test_layering.py reads this list and checks
every import of every module; docs/design.md says what each folder holds):

1. base: config, specs, server_math, timing, outputs
2. pieces: data, models, algorithms
3. local math: client_update, objectives, personalization
4. clients: clients
5. federation state: federation_state
6. executors: executors
7. round loop: round_loop
8. a run: lifecycle
9. drivers: drivers
10. command line: cli

A folder stands for all its modules. The HTTP service (``api/``) imports only the first two layers;
``api/``, ``tune/`` and ``flower/`` import the library, never the other way round.
"""

__version__ = "0.3.0"
