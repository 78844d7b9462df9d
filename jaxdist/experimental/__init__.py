"""Experimental names, as in ``tf.distribute.experimental``."""

from jaxdist.input.options import AutoShardPolicy
from jaxdist.values import ValueContext

__all__ = ["AutoShardPolicy", "ValueContext"]
