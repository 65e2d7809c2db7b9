"""free_port picks ports a server can still bind a moment later: below the kernel's ephemeral
range (where outgoing connections take their source ports) and above Ray's worker ports."""

import socket

from plait.comm import free_port


def test_free_ports_sit_below_the_ephemeral_range_and_a_span_is_bindable():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        port = free_port(span=3)
        assert 20000 <= port and port + 3 <= max(low, 20003)
        socks = [socket.socket() for _ in range(3)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))  # every port of the span is free
        finally:
            for s in socks:
                s.close()
