"""``python -m mxport.cli``: the same as the ``mxport`` command."""

from . import main

if __name__ == "__main__":
    main()
