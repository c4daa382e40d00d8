"""What the kernel's TCP stack counted on a socket: the data segments it received (each ``send``
of the peer, with Nagle off, is at least one), read with TCP_INFO. Counts, not times."""

from __future__ import annotations

import socket
import struct

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, u32, after the fields up to tcpi_min_rtt.
_DATA_SEGS_IN = 152


def data_segs_in(sock: socket.socket) -> int:
    """Data segments received on ``sock`` so far (Linux 4.6+)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _DATA_SEGS_IN + 4:
        raise RuntimeError("this kernel's tcp_info has no tcpi_data_segs_in")
    return int(struct.unpack_from("I", info, _DATA_SEGS_IN)[0])
