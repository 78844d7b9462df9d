"""Experimental names, as in ``tf.distribute.experimental``."""

from jaxdist.values import ValueContext

__all__ = ["ValueContext"]
