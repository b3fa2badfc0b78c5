"""``python -m frontend ROUTER_CONFIG``: the router process a deployment's launcher starts."""

from __future__ import annotations

import argparse
import logging

from frontend.config import RouterConfig
from frontend.server import serve


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m frontend", description=__doc__.splitlines()[0])
    p.add_argument("config", help="router config (YAML), rendered by `disagg launch`")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(RouterConfig.load(a.config))


if __name__ == "__main__":
    main()
