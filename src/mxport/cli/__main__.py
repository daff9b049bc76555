"""``python -m mxport.cli``: the same as the ``mxport`` command."""

from . import main

main()
