"""``python -m course_helper compare ...`` - see :mod:`course_helper.cli`."""
import sys

from .cli import main

sys.exit(main())
