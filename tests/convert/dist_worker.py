"""Worker for the torch_dist tests, run as `python dist_worker.py` or under torch.distributed.run.

For each HF model given: convert it with hf_to_dist (every rank), load the checkpoint into this
job's megatron-core GPTModel (that model's tp/pp/ep from --sizes; one process group serves
all), run a forward pass (pipeline stages exchange activations with send/recv, TP logits are
all-gathered), compare with the transformers model's logits, then (rank 0, in a fresh one-process group) convert back with dist_to_hf and
compare every tensor bit for bit. Results go to --result as JSON; the test asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path


def _logits_error(hf_dir: Path, dist_dir: Path, *, tp: int, pp: int, ep: int) -> float | None:
    """Max |megatron - transformers| logit difference on the last stage (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from rltool.convert.gpt_model import build_gpt_model
    from rltool.convert.torch_dist import load_model_weights

    config = json.loads((hf_dir / "config.json").read_text())
    model = build_gpt_model(config, tp=tp, pp=pp, ep=ep, perform_initialization=False)
    load_model_weights(model, dist_dir)
    model.eval()
    ids = torch.randint(0, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(ids.shape[1], ids.shape[0], config["hidden_size"])
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
        expect = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()(ids).logits
    return (out[..., : config["vocab_size"]] - expect).abs().max().item()


def _bit_exact(hf_dir: Path, back_dir: Path) -> list[str]:
    """Names of tensors that differ (or are missing) after HF -> dist -> HF."""
    import torch
    from safetensors import safe_open

    def read(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    a, b = read(hf_dir), read(back_dir)
    return sorted(k for k in set(a) | set(b)
                  if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", nargs="+", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--sizes", nargs="+", default=None,
                        help="tp,pp,ep for each --hf model (default 1,1,1)")
    args = parser.parse_args()
    sizes = [dict(zip(("tp", "pp", "ep"), map(int, s.split(",")), strict=True))
             for s in (args.sizes or ["1,1,1"] * len(args.hf))]

    import torch
    import torch.distributed as dist

    from rltool import megatron_compat
    from rltool.convert.torch_dist import (DistToHfConfig, HfToDistConfig, dist_to_hf,
                                           hf_to_dist)

    torch.set_num_threads(1)
    work = Path(args.work)
    results = {}
    jobs = [(f"{i}-{Path(hf).name}", Path(hf), size)
            for i, (hf, size) in enumerate(zip(args.hf, sizes, strict=True))]
    megatron_compat.init_distributed()  # one process group for all the models below
    for name, hf, size in jobs:
        dist_dir = work / f"{name}-dist"
        info = hf_to_dist(HfToDistConfig(hf=hf, out=dist_dir, **size))
        megatron_compat.init_distributed(**size)
        results[name] = {"padded_vocab_size": info["padded_vocab_size"],
                         "logits_error": _logits_error(hf, dist_dir, **size)}
    rank = dist.get_rank()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, {k: v["logits_error"] for k, v in results.items()})
    dist.destroy_process_group()
    if rank != 0:
        return
    for name in results:
        results[name]["logits_error"] = max((e[name] for e in errors if e[name] is not None),
                                            default=None)
    # dist-to-hf is a one-process command: leave torchrun's world for a fresh group of one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchrun's agent store expects the whole world; a group of one rendezvous on its own port
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="False")
    for name, hf, _ in jobs:
        back = work / f"{name}-back"
        dist_to_hf(DistToHfConfig(dist=work / f"{name}-dist", hf_config=hf, out=back))
        results[name]["mismatched"] = _bit_exact(hf, back)
    Path(args.result).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
