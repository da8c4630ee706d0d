"""The GPU suite's release check names what holds leaked memory (tests/helpers/leaks.py), shown
here on CPU tensors: the largest first, each with the attribute and key path that keeps it."""

from __future__ import annotations

import torch

from tests.helpers.leaks import describe, holder_chain, live_tensors


class Pool:
    def __init__(self):
        self.buffers = {"kv": torch.zeros(1 << 18)}


class Holder:
    def __init__(self):
        self.pool = Pool()
        self.small = [torch.zeros(16)]


KEPT: list = []


def test_each_live_tensor_comes_with_the_path_that_holds_it():
    KEPT.append(Holder())
    try:
        kv = KEPT[0].pool.buffers["kv"]
        found = live_tensors("cpu")
        assert [n for n, _ in found] == sorted((n for n, _ in found), reverse=True)
        assert {id(t): n for n, t in found}[id(kv)] == kv.numel() * 4
        del found  # its (bytes, tensor) pairs would be the first holders found
        assert holder_chain(kv).startswith("['kv'] <- Pool.buffers <- Holder.pool <- [0] <- ['KEPT']")
        assert holder_chain(KEPT[0].small[0]).startswith("[0] <- Holder.small <- [0] <- ['KEPT']")
        assert describe("meta") == "no gc-visible meta tensor"
        # a functional (traced) tensor has no data pointer: left out, not an error
        KEPT.append(torch._to_functional_tensor(torch.ones(4)))
        assert all(t is not KEPT[-1] for _, t in live_tensors("cpu"))
    finally:
        KEPT.clear()
