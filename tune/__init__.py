"""Ray Tune sweeps of whole federations: ``fedrod-ray tune --config tune/<name>.yaml``.

``space`` reads and checks a sweep file, ``trial`` runs one federation as a Tune trial, ``sweep`` runs
the sweep and writes its results; ``cli`` adds the ``tune`` command to ``fedrod-ray``.
"""
