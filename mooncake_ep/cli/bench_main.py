"""Run the benchmark alone: ``python -m mooncake_ep.cli.bench_main`` (same flags as ``bench``)."""

import argparse
import sys

from mooncake_ep.cli import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mooncake_ep bench", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))
