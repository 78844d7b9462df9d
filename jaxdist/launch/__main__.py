"""``python -m jaxdist.launch``: see `jaxdist.launch.cli`."""

import sys

from jaxdist.launch.cli import main

sys.exit(main())
