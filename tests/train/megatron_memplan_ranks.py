"""One rank of tests/train/test_megatron_memplan.py's multi-rank check, run under torchrun:
build the megatron trainer of a layout on the CPU, take one step, and write this rank's real
state bytes beside the plan's for its pipeline stage (`OUT/rank-N.json`); the layout's options
may add LoRA (`{"lora_rank": 3}`).

    torchrun --nproc-per-node 2 tests/train/megatron_memplan_ranks.py MODEL OUT '{"tp": 2}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # torch_dist's writer spawns processes: nothing runs on import
    import torch.distributed as dist

    from rltool.train import megatron_memplan as mplan
    from rltool.train import memfit
    from rltool.train.backend import MicroBatch
    from rltool.train.config import BackendConfig
    from rltool.train.launch import process_group_scope
    from rltool.train.megatron_backend import MegatronBackend
    from tests.train.test_megatron_memplan import _megatron_bytes, loss_fn

    model, out, layout = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    options = BackendConfig(backend="megatron", device="cpu", **layout)
    batch = MicroBatch([0, 1], [[5, 6, 7, 8, 9, 10], [4, 3, 2, 1]], [2, 1])
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        backend.train_step([batch], loss_fn, temperature=1.0)
        real = _megatron_bytes(backend)
        stage = "first" if backend.ps.is_pipeline_first_stage() and \
            not backend.ps.is_pipeline_last_stage() else "last"
        hf = json.loads((model / "config.json").read_text())
        shape = mplan.ModelShape.of(hf)
        layout = mplan.Layout.of(options, world_size=dist.get_world_size())
        plan = mplan.state_bytes(shape, layout, dtype="fp32", stage=stage,
                                 lora=memfit.megatron_lora(options, hf))[0]
        padding = sum(mplan.buffer_numel(numels, dp=layout.dp, distributed_optimizer=True)
                      - sum(numels) for numels in mplan.local_params(shape, layout, stage=stage))
        (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(
            {"real": real, "plan": plan, "stage": stage, "padding": padding}))
