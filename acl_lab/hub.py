"""A quick check that the Hugging Face hub answers, so offline users get a clear error in seconds.

Without it, a hub load on a machine without internet retries for the best part
of a minute before failing with a traceback from deep inside a library.
"""
from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse


@lru_cache(maxsize=1)
def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """``None`` when the hub's endpoint accepts a connection, else a short reason."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except Exception:  # noqa: BLE001 - an old huggingface_hub: fall back to its documented default
        endpoint = "https://huggingface.co"
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError as exc:
        return f"cannot connect to {url.hostname} ({exc.strerror or exc})"
    return None
