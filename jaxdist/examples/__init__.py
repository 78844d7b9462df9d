"""Runnable examples: ``python -m jaxdist.examples.train_mlp``."""
