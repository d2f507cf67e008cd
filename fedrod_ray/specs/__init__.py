"""What the config must know of each plug-in, without importing it (torch): its name, its hyperparameters
and its constraints (what it supports, what it needs, what has no effect with it).

One module per kind of plug-in: ``rules`` (``train.generic_rule``), ``methods`` (``train.head``),
``losses`` (``train.balanced_loss``), ``datasets`` (``data.dataset``), ``models`` (``model.arch``). Each
registry (``fedrod_ray.algorithms``, ``.personalization``, ``.losses`` and ``.objectives``, ``.data``,
``.models``) checks on import that it holds exactly the names its spec declares; ``fedrod_ray.config`` reads
the specs and lists no name of its own (docs/extending.md).
"""
