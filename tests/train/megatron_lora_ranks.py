"""The megatron LoRA run of tests/train/test_megatron_lora.py for one layout: in the test's process
(TP1) or one rank of a torchrun (TP2):

    torchrun --nproc-per-node 2 tests/train/megatron_lora_ranks.py MODEL OUT \
        '{"tensor_model_parallel_size": 2}'

Builds the trainer with LoRA, takes two optimizer steps on a fixed micro-batch with a checkpoint
after the first, resumes that checkpoint in a fresh trainer and takes its second step again.
Global rank 0 writes OUT/: the adapters (PEFT names, fp32) at init, after each step, after the
resumed step and after loading the checkpoint's adapter/ files again; the step metrics; whether
the base's HF tensors stayed equal over the first step; each rank's trainable and
gradient-buffered parameter names; and the logprobs of the micro-batch with the adapters on and
off after the second step. `layout` adds to or overrides the options (TP, PP, EP, the
distributed optimizer, device and dtype, LoRA targets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from rltool.train.backend import MicroBatch

BATCH = MicroBatch([0, 1], [[5, 6, 7, 8, 9, 10, 11, 3], [4, 3, 2, 1, 9, 8]], [3, 2])
LORA = dict(lora_rank=4, lora_alpha=8.0)
OPTIONS = dict(backend="megatron", device="cpu", lr=1e-2, adam_eps=1e-6)


def loss_fn(out: Any, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every data-parallel rank trains on BATCH: each takes its share of the one loss."""
    from megatron.core import parallel_state as ps

    loss = -sum((lp * lp.exp()).sum() for lp in out.logprobs) / 9
    loss = loss / ps.get_data_parallel_world_size()
    return loss, {"loss": loss.detach()}


def run_layout(model: Path, out: Path, layout: dict[str, Any]) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rltool.train import megatron_state
    from rltool.train.config import BackendConfig
    from rltool.train.launch import process_group_scope
    from rltool.train.megatron_backend import MegatronBackend

    options = BackendConfig(**{**OPTIONS, **LORA, **layout})
    torch.manual_seed(0)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        params = list(backend.module.named_parameters())
        own = {"trainable": sorted(n for n, p in params if p.requires_grad),
               "buffered": sorted(n for n, p in params if p in backend.model.param_to_bucket_group),
               "adapter_dtypes": sorted({str(p.dtype) for _, p in params if p.requires_grad})}
        record: dict[str, Any] = {"ranks": backend.all_gather_object(own),
                                  "pp": options.pipeline_model_parallel_size}
        tensors = {"init": backend.export_adapter()}
        base = megatron_state.export_hf(backend.module, backend.hf_config)
        metrics = [backend.train_step([BATCH], loss_fn, temperature=1.0)]
        tensors["step1"] = backend.export_adapter()
        after = megatron_state.export_hf(backend.module, backend.hf_config)
        record["base_unchanged"] = base.keys() == after.keys() and all(
            torch.equal(base[k], after[k]) for k in base)
        backend.save(out / "ckpt", trainer_state={"policy_version": 1}, data_tensors={},
                     config_toml="")
        metrics.append(backend.train_step([BATCH], loss_fn, temperature=1.0))
        tensors["step2"] = backend.export_adapter()
        on = backend.forward_logprobs(BATCH, temperature=1.0).logprobs
        with backend.adapters_off():
            off = backend.forward_logprobs(BATCH, temperature=1.0).logprobs
        del backend

        resumed = MegatronBackend(model, options=options)
        resumed.load(out / "ckpt")
        tensors["loaded"] = resumed.export_adapter()
        record["resumed_metrics"] = resumed.train_step([BATCH], loss_fn, temperature=1.0)
        tensors["resumed"] = resumed.export_adapter()
        resumed.load_adapter(out / "ckpt" / "adapter")  # the PEFT files, into every rank's shards
        tensors["reloaded"] = resumed.export_adapter()
        if dist.get_rank() == 0:
            record["metrics"] = metrics
            record["logprobs_on"] = [lp.tolist() for lp in on]
            record["logprobs_off"] = [lp.tolist() for lp in off]
            (out / "record.json").write_text(json.dumps(record))
            for name, state in tensors.items():
                save_file(state, str(out / f"{name}.safetensors"))


if __name__ == "__main__":  # torch_dist's writer spawns processes: nothing runs on import
    run_layout(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
