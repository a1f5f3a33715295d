"""What placement needs to know about this host: its ephemeral ports, vLLM's cache root,
and the address other nodes reach it at.

Core's :func:`genworker.core.placement.configure_worker` takes the first two as arguments;
these read them (the only reads of ``/proc`` and of ``VLLM_CACHE_ROOT`` in genworker).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping

from genworker.core.placement import DEFAULT_EPHEMERAL_PORTS, parse_port_range
from genworker.shell.errors import BadConfigError, UnsupportedError, unwrap

__all__ = ["PORT_RANGE_FILE", "ephemeral_ports", "node_ip", "vllm_cache_root"]

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


def node_ip() -> str:
    """This node's address as other nodes reach it: Ray's node IP in a process of a Ray
    cluster (as NeMo-RL's ``_get_node_ip_local``), else the address of the host's name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        raise UnsupportedError(f"this host's name {name!r} does not resolve: {e}") from e
