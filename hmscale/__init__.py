"""hmscale: distil Pythia / GPT-NeoX into pure Mamba-2 (SSD) models with the HedgeMamba recipe."""

__version__ = "0.1.0"
