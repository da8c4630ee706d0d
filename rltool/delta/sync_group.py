"""The process group weights are broadcast over (`/init_weights_update_group`): a TCPStore at the
trainer's address and a group of its own (not the default group, which the trainer may use for
data parallelism), trainer rank 0, engine rank `rank_offset`: gloo (tensors through host memory)
or, between processes on different GPUs, NCCL (tensors on each process's current CUDA device; two
ranks on one GPU are refused by NCCL, so a trainer sharing the engine's GPU uses gloo).

Every listening socket is bound to one address, never to all interfaces: rank 0's store listens
on a socket bound here to `master_address` (torch's TCPStore would otherwise listen on every
interface, and anyone who reaches the port could fill the store with keys), and each rank's gloo
device binds the address of its interface that reaches the master (gloo's default device binds
whatever the host name resolves to). Whoever reaches these ports can still join or disturb a
group: off one host, sync over a network you trust.

The engine joins only groups of at most `MAX_SYNC_WORLD_SIZE` ranks, at hosts its
`--allowed-sync-hosts` allow, and within the request's `timeout_s`.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from rltool.delta.sync_limits import DEFAULT_SYNC_TIMEOUT_S, MAX_SYNC_WORLD_SIZE
from rltool.errors import BadInputError, RltoolError


class SyncTimeoutError(RltoolError):
    """The group did not form within its timeout (a master that does not answer, ranks that do
    not join)."""


class SyncHostRefusedError(BadInputError):
    """`master_address` is not one of the hosts the engine may sync with."""


def resolve(address: str, port: int) -> tuple[int, str]:
    """(address family, numeric address) of `address`, the first that getaddrinfo returns."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address.strip("[]"), port,
                                                       type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise BadInputError(f"master_address {address!r} does not resolve: {e}; send an "
                            "address this host can reach") from e
    return family, str(sockaddr[0])


def host_allowed(address: str, ip: str, allowed: Sequence[str]) -> bool:
    """True when `allowed` is empty, names `address` as written, or holds an address or network
    (CIDR) containing `ip`, the address it resolved to (the one then connected to)."""
    if not allowed:
        return True
    ip_obj = ipaddress.ip_address(ip)
    for entry in allowed:
        if entry.strip("[]").lower() == address.strip("[]").lower():
            return True
        try:
            if ip_obj in ipaddress.ip_network(entry.strip("[]"), strict=False):
                return True
        except ValueError:  # a host name: matched as written above
            continue
    return False


def listen_fd(family: int, ip: str, port: int) -> int:
    """A listening TCP socket bound to `ip` only, as a descriptor the TCPStore takes over (it
    closes it, also when it fails to start)."""
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((ip, port))
        s.listen(128)
    except OSError as e:
        s.close()
        raise BadInputError(f"cannot listen on {ip}:{port} for the weight update group: "
                            f"{e.strerror}; choose a free port on an address of this host") from e
    return s.detach()


def local_address(family: int, ip: str, port: int) -> str:
    """The address of this host's interface that reaches `ip` (a route lookup: connecting a UDP
    socket sends nothing)."""
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, port))
        except OSError as e:
            raise BadInputError(f"no route to the weight update group's master {ip}: "
                                f"{e.strerror}") from e
        return str(s.getsockname()[0])


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def join_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               backend: str = "gloo", timeout_s: float = DEFAULT_SYNC_TIMEOUT_S,
               allowed_hosts: Sequence[str] = ()) -> Any:
    """A process group of its own for weight broadcasts (rank 0 hosts the store): gloo, or nccl
    when CUDA is available. BadInputError for arguments refused before connecting,
    SyncHostRefusedError for a master outside `allowed_hosts`, SyncTimeoutError when the group
    does not form within `timeout_s`."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise BadInputError(f"backend {backend!r} is not served; use \"gloo\" or \"nccl\"")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise BadInputError("backend \"nccl\" needs CUDA in both processes; this one has none, "
                            "use backend \"gloo\"")
    if world_size > MAX_SYNC_WORLD_SIZE:
        raise BadInputError(f"world_size {world_size} exceeds the limit of "
                            f"{MAX_SYNC_WORLD_SIZE} ranks; sync larger fleets in several groups")
    if not 0 <= rank < world_size:
        raise BadInputError(f"rank {rank} is outside world_size {world_size}")
    deadline = time.monotonic() + timeout_s
    family, ip = resolve(master_address, master_port)
    if not host_allowed(master_address, ip, allowed_hosts):
        raise SyncHostRefusedError(f"master_address {master_address} ({ip}) is not in "
                                   f"--allowed-sync-hosts {list(allowed_hosts)}; add it there "
                                   "or sync with an allowed host")
    where = f"the weight update group at {master_address}:{master_port} as rank {rank}"
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(ip, master_port, world_size, True, timeout=timeout,
                                  master_listen_fd=listen_fd(family, ip, master_port))
            bind = ip
        else:
            store = dist.TCPStore(ip, master_port, world_size, False, timeout=timeout)
            bind = local_address(family, ip, master_port)
        # What is left of the timeout bounds the group's own rendezvous.
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = left
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
            return dist.ProcessGroupGloo(store, rank, world_size, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = left
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except MemoryError as e:
        raise BadInputError(f"not enough memory to join {where} of {world_size} ranks; use a "
                            "smaller world_size") from e
    except (RuntimeError, ValueError) as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise SyncTimeoutError(f"cannot join {where} within {timeout_s:g} s: "
                                   f"{_first_line(e)}") from e
        raise BadInputError(f"cannot join {where}: {_first_line(e)}") from e
