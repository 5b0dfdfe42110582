#!/usr/bin/env python3
"""Fetch the chat page's third-party browser libraries from the npm registry (with `npm pack`,
which checks each tarball's integrity) into pagelm/serve/ui/vendor/, with their licenses.

Run it to update them: change a version in PINS, run `python scripts/fetch_ui_vendor.py`, commit
pagelm/serve/ui/vendor/. Nothing is fetched at run time: pagelm serves the committed files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[1] / "pagelm" / "serve" / "ui" / "vendor"

# package, version, {file in the package: name under vendor/}
PINS = [
    ("marked", "18.2.1", {"lib/marked.umd.js": "marked.umd.js", "LICENSE": "LICENSE.marked"}),
    ("dompurify", "3.4.18", {"dist/purify.min.js": "purify.min.js", "LICENSE": "LICENSE.dompurify"}),
    ("@highlightjs/cdn-assets", "11.12.0", {"highlight.min.js": "highlight.min.js",
                                            "styles/github.min.css": "hljs-light.min.css",
                                            "styles/github-dark.min.css": "hljs-dark.min.css",
                                            "LICENSE": "LICENSE.highlightjs"}),
]


def fetch(package: str, version: str, files: dict[str, str], scratch: Path) -> None:
    packed = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(scratch), f"{package}@{version}"],
                            check=True, capture_output=True, text=True).stdout
    tarball = scratch / json.loads(packed)[0]["filename"]
    with tarfile.open(tarball) as archive:
        for inside, name in files.items():
            member = archive.extractfile(f"package/{inside}")
            if member is None:
                sys.exit(f"fetch_ui_vendor: {package}@{version} has no file {inside}")
            (VENDOR / name).write_bytes(member.read())


def main() -> int:
    VENDOR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for package, version, files in PINS:
            fetch(package, version, files, Path(scratch))
            print(f"fetch_ui_vendor: {package}@{version} -> {', '.join(files.values())}")
    (VENDOR / "VERSIONS").write_text("".join(f"{p}@{v}\n" for p, v, _ in PINS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
