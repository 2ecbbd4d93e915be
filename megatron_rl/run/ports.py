"""The rendezvous port: a free one, whether ``host:port`` can host the rendezvous store here, and the
network interface that reaches the rendezvous host (what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME should
name, so the process groups listen there only: docs/reliability.md, Security and ports).

Standard library only: ``launch/torchrun.sh`` runs the check (``python -m megatron_rl.run.launch_checks
port HOST PORT``) before torchrun starts, ahead of any heavy import; ``python -m megatron_rl.run.ports
interface HOST`` prints the interface's name.
"""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import sys


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot host the rendezvous store on this machine, or None if it can.

    Binds the way torch's TCPStore server does (all interfaces, SO_REUSEADDR, so a port in TIME_WAIT
    is not reported) and checks that ``host`` names this machine.
    """
    try:
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)}
    except socket.gaierror as e:
        return (
            f"rendezvous host {host!r} (MASTER_ADDR) does not resolve on this node ({e.strerror}): "
            "use a hostname or IP of node 0."
        )
    for addr in sorted(addrs):
        if addr.startswith("127."):
            continue
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return (
                    f"rendezvous host {host} (MASTER_ADDR) resolves to {addr}, which is not an address of "
                    f"this machine ({socket.gethostname()}), but this node (node rank 0) hosts the "
                    "rendezvous: set MASTER_ADDR to node 0's hostname or IP."
                )
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return busy_port_message(port)
            return (
                f"cannot listen on rendezvous port {port} ({e.strerror}): choose another port with "
                f"MASTER_PORT (e.g. MASTER_PORT={free_port()})."
            )
    return None


def busy_port_message(port: int | str) -> str:
    return (
        f"rendezvous port {port} is already in use on node 0 (another job or a leftover process holds it): "
        f"set MASTER_PORT to a free port (e.g. MASTER_PORT={free_port()}) or stop the process holding it "
        f"(ss -ltnp 'sport = :{port}')."
    )


_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def _interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address reaches ``host`` (the
    interface holding it on node 0, the one the route to it leaves by on the others), or None when it
    cannot be told (no route, not Linux)."""
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP: chooses the route, sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _interface_address(name) == local:
            return name
    return None


if __name__ == "__main__":  # python -m megatron_rl.run.ports interface HOST
    if len(sys.argv) != 3 or sys.argv[1] != "interface":
        sys.exit("usage: python -m megatron_rl.run.ports interface HOST")
    name = interface_of(sys.argv[2])
    if name is None:
        sys.exit(1)
    print(name)
