"""Configs: the typed-config machinery (``base``), the algorithm, optimizer and staleness configs
(``components``), the algorithm presets (``presets``) and the dataset-file configs (``data``).

Nothing here imports torch. Import the public names from :mod:`relax_core`; these modules are its internals.
"""
