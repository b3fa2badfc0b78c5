"""Hard-link identical weight files under a folder (the image's engines: prefill and decode engines of one
checkpoint carry the same weights, one copy is enough). Prints the bytes saved."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def main(root: Path) -> int:
    seen: dict[tuple[int, str], Path] = {}
    saved = 0
    for f in sorted(root.rglob("*.safetensors")):
        digest = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
        key = (f.stat().st_size, digest.hexdigest())
        if key in seen:
            f.unlink()
            os.link(seen[key], f)
            saved += key[0]
        else:
            seen[key] = f
    print(f"hard-linked identical weights: {saved / 2**20:.0f} MiB saved")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
