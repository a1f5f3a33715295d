"""What placement needs to know about this host: its ephemeral ports and vLLM's cache root.

Core's :func:`genworker.core.placement.configure_worker` takes both as arguments; these
read them (the only reads of ``/proc`` and of ``VLLM_CACHE_ROOT`` in genworker).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from genworker.core.placement import DEFAULT_EPHEMERAL_PORTS, parse_port_range
from genworker.shell.errors import BadConfigError, unwrap

__all__ = ["PORT_RANGE_FILE", "ephemeral_ports", "vllm_cache_root"]

log = logging.getLogger(__name__)

PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports(path: str | None = None) -> tuple[int, int]:
    """The host's ephemeral port range (``path``: :data:`PORT_RANGE_FILE`); Linux's default
    where the file does not exist (not Linux). A file that does not parse is a
    :class:`BadConfigError`."""
    path = PORT_RANGE_FILE if path is None else path
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except FileNotFoundError:
        log.info("%s not found; assuming ephemeral ports %s", path, DEFAULT_EPHEMERAL_PORTS)
        return DEFAULT_EPHEMERAL_PORTS
    return unwrap(parse_port_range(text), BadConfigError, path)


def vllm_cache_root(environ: Mapping[str, str] | None = None) -> str:
    """The inherited ``VLLM_CACHE_ROOT``, else ``~/.cache/vllm`` (vLLM's own default)."""
    env = os.environ if environ is None else environ
    return env.get("VLLM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "vllm")
