"""``python -m mooncake_ep <command>``: see :mod:`mooncake_ep.cli`."""

import sys

from mooncake_ep.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m mooncake_ep"))
