"""``python -m mooncake_ep <command>``: see :mod:`mooncake_ep.cli`."""

import sys

from mooncake_ep.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:], prog="python -m mooncake_ep"))
