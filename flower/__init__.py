"""fedrod-ray on Flower's deployment and simulation engines (installed as ``fedrod_ray_flower``;
``pip install fedrod-ray[flower]``).

A Flower ServerApp (``server_app``) runs fedrod-ray's round loop (``fedrod_ray.round_loop.federation``) with
an executor (``executor``) whose clients live on SuperNodes; each SuperNode's ClientApp (``client_app``)
trains its own clients with fedrod-ray's ``ClientHost``, from the data at its node config's ``data-path``,
and keeps their state under its ``state-path`` (``node``; a simulated SuperNode, under the run config's
``sim-data-path`` and ``sim-state-path``). Every rule, personalization method and loss is
fedrod-ray's own code: nothing here is specific to one of them. docs/flower.md says how to run it.
"""
