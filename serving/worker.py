"""``python -m serving.worker NODE_CONFIG``: a TP follower rank of a deployment (mpirun starts it)."""

from __future__ import annotations

import logging
import sys

from serving.node import follower
from serving.node_config import NodeConfig


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m serving.worker NODE_CONFIG", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node = NodeConfig.load(args[0])
    follower(node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
