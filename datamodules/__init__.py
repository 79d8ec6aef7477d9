"""Lightning data modules for mixlab (installed as ``mixlab.datamodules``).

Import a module explicitly, e.g. ``from mixlab.datamodules.genome import GenomeDataModule``;
this package deliberately imports nothing heavy.
"""
