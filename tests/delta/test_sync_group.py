"""The weight-sync process group (rltool.delta.sync_group): every socket it listens on is bound to
the address it was given, its size and hosts are bounded, and a group of two still broadcasts."""

from __future__ import annotations

import gc
import socket
import threading
from pathlib import Path

import pytest
import torch

from rltool.delta import sync_group, tensor_sync
from rltool.delta.sync_limits import MAX_SYNC_WORLD_SIZE
from rltool.errors import BadInputError
from rltool.supervisor import free_port

pytestmark = pytest.mark.timeout(120)


def listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc/net/tcp{,6}."""
    fds = Path("/proc/self/fd")
    inodes = set()
    for fd in fds.iterdir():
        try:
            link = fd.readlink()
        except OSError:
            continue
        if str(link).startswith("socket:["):
            inodes.add(str(link)[8:-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            raw, port = cols[1].split(":")
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            packed = b"".join(bytes.fromhex(raw[i:i + 8])[::-1] for i in range(0, len(raw), 8))
            out.add((socket.inet_ntop(family, packed), int(port, 16)))
    return out


def other_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1 that a client could try: ::1 and the
    address of the interface that routes off the host, when there is one."""
    found = ["::1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a documentation address: only the route is looked up
            if not s.getsockname()[0].startswith("127."):
                found.append(s.getsockname()[0])
        except OSError:
            pass
    return found


def test_the_rendezvous_listens_only_on_the_master_address():
    """Rank 0's TCPStore listened on every interface (a client over ::1 could fill it with keys)
    and gloo's device bound what the host name resolved to; now every socket the group listens
    on is bound to 127.0.0.1, and the store's port refuses other local addresses."""
    before = listening()
    port = free_port()
    joined: dict[str, object] = {}
    engine_side = threading.Thread(target=lambda: joined.update(g1=sync_group.join_group(
        master_address="127.0.0.1", master_port=port, rank=1, world_size=2, timeout_s=60)))
    engine_side.start()
    g0 = sync_group.join_group(master_address="127.0.0.1", master_port=port, rank=0,
                               world_size=2, timeout_s=60)
    engine_side.join(60)
    assert "g1" in joined
    new = listening() - before
    assert ("127.0.0.1", port) in new
    assert {addr for addr, _ in new} == {"127.0.0.1"}, new
    for addr in other_addresses():
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=5).close()
    # The group works: rank 0 broadcasts to rank 1.
    sent, got = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    receiver = threading.Thread(target=tensor_sync.broadcast, args=(joined["g1"], [got]))
    receiver.start()
    tensor_sync.broadcast(g0, [sent])
    receiver.join(60)
    assert got.equal(sent)
    del g0
    joined.clear()  # the engine side's group goes too (the thread's lambda holds the dict)
    gc.collect()


def test_group_arguments_are_refused_before_connecting():
    """A world_size of 10**7 made the engine allocate per-rank state until MemoryError; sizes
    past the limit, ranks outside the group and unresolvable hosts are refused up front."""
    with pytest.raises(BadInputError, match=f"limit of {MAX_SYNC_WORLD_SIZE} ranks"):
        sync_group.join_group(master_address="127.0.0.1", master_port=1, rank=1,
                              world_size=10**7)
    with pytest.raises(BadInputError, match="outside world_size"):
        sync_group.join_group(master_address="127.0.0.1", master_port=1, rank=3, world_size=2)
    with pytest.raises(BadInputError, match="does not resolve"):
        sync_group.join_group(master_address="no-such-host.invalid", master_port=1, rank=1,
                              world_size=2)


def test_a_master_that_never_answers_is_a_sync_timeout():
    """Nothing listens on the port: the join gives up with SyncTimeoutError after timeout_s."""
    with pytest.raises(sync_group.SyncTimeoutError, match="within 1 s"):
        sync_group.join_group(master_address="127.0.0.1", master_port=free_port(), rank=1,
                              world_size=2, timeout_s=1)


@pytest.mark.parametrize("address,ip,allowed,ok", [
    ("127.0.0.1", "127.0.0.1", [], True),  # no list: any host
    ("127.0.0.1", "127.0.0.1", ["127.0.0.0/8"], True),
    ("10.1.2.3", "10.1.2.3", ["10.0.0.0/8"], True),
    ("trainer-0", "10.9.9.9", ["Trainer-0"], True),  # a host name, as written
    ("trainer-0", "10.9.9.9", ["10.9.9.9"], True),  # what the name resolves to
    ("::1", "::1", ["[::1]"], True),
    ("127.0.0.1", "127.0.0.1", ["10.0.0.0/8", "trainer-0"], False),
    ("evil", "10.9.9.9", ["trainer-0", "192.168.0.0/16"], False),
])
def test_allowed_sync_hosts_match_names_addresses_and_networks(address, ip, allowed, ok):
    assert sync_group.host_allowed(address, ip, allowed) is ok


def test_a_master_outside_the_allowed_hosts_is_refused_before_connecting():
    with pytest.raises(sync_group.SyncHostRefusedError, match="--allowed-sync-hosts"):
        sync_group.join_group(master_address="127.0.0.1", master_port=1, rank=1, world_size=2,
                              allowed_hosts=["10.0.0.0/8"])
