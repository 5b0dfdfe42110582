"""pagelm's own directory: $PAGELM_HOME, else the user's cache directory (~/.cache/pagelm).

Owns only where it is; what lies there is the store's and the Hub client's.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """$PAGELM_HOME, else the user's cache directory (~/.cache/pagelm)."""
    if os.environ.get("PAGELM_HOME"):
        return Path(os.environ["PAGELM_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagelm"
