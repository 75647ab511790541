"""``python -m torchacc ...``: the same as the ``torchacc`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
