"""dflash-train: train DFlash speculative-decoding drafters for any Hugging Face causal LM."""

__version__ = "0.1.0"
