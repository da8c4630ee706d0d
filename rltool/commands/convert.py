import click

from rltool.commands.common import echo_json
from rltool.commands.options import build_config, command_options, stage_options
from rltool.convert.fp8 import DequantConfig, Fp8Config
from rltool.convert.int4 import Int4Config
from rltool.convert.torch_dist import DistToHfConfig, HfToDistConfig

TABLE = "convert"


@click.group("convert")
def command():
    """Convert checkpoints: HF <-> Megatron torch_dist, block-FP8 and INT4 (W4A16) quantization.

    \b
    Example:
      rltool convert fp8 --hf models/tiny --out models/tiny-fp8 --verify
    """


def _report(result, *, as_json, verb):
    if as_json:
        echo_json(result)
    else:
        click.echo(f"{verb} -> {result['out']} ({result.get('seconds', 0):.1f} s)", err=True)


@command.command("fp8")
@stage_options(Fp8Config, table=TABLE)
@command_options("config", "json")
def fp8(as_json, **_):
    """Quantize an HF checkpoint to block-wise float8_e4m3fn with fp32 weight_scale_inv.

    Norms, embeddings, lm_head, router gates and biases keep their dtype; config.json gains a
    quantization_config that SGLang and vLLM understand. --verify prints each tensor's relative
    dequantization error ||deq-w||/||w||.

    \b
    Example:
      rltool convert fp8 --hf models/qwen --out models/qwen-fp8 --block 128 128 --verify
    """
    from rltool.convert.fp8 import quantize_checkpoint

    cfg = build_config(Fp8Config, table=TABLE)
    result = quantize_checkpoint(cfg)
    _report_quantized(result, cfg, as_json=as_json, suffix="")


@command.command("int4")
@stage_options(Int4Config, table=TABLE)
@click.option("--symmetric/--asymmetric", "symmetric_flag", default=None,
              help="Symmetric groups (scale only) or asymmetric ones (scale and zero point).  "
                   "[default: symmetric]")
@command_options("config", "json")
def int4(as_json, symmetric_flag, **_):
    """Quantize an HF checkpoint to INT4 weights, bf16 activations (W4A16), group-wise.

    Writes compressed-tensors' pack-quantized format (weight_packed int32, weight_scale,
    weight_zero_point when asymmetric, weight_shape; config.json's quantization_config), what
    slime's INT4 converter writes and vLLM and SGLang load. Default --ignore: for MoE models
    slime's list (only the routed experts' linears become INT4), for dense models every linear
    layer but lm_head. Norms, embeddings and biases are never quantized. --verify prints each
    tensor's relative dequantization error ||deq-w||/||w||.

    \b
    Example:
      rltool convert int4 --hf models/qwen3-moe --out models/qwen3-moe-int4 --group-size 32
      rltool convert int4 --hf models/qwen --out models/qwen-int4 --asymmetric --ignore lm_head \\
          --ignore 're:.*self_attn.*'
    """
    from rltool.convert.int4 import quantize_checkpoint

    extra = {} if symmetric_flag is None else {"symmetric": symmetric_flag}
    cfg = build_config(Int4Config, table=TABLE, extra=extra)
    result = quantize_checkpoint(cfg)
    _report_quantized(result, cfg, as_json=as_json, suffix=" to INT4")


@command.command("dequant")
@stage_options(DequantConfig, table=TABLE)
@command_options("config", "json")
def dequant(as_json, **_):
    """Dequantize a block-FP8 (q * weight_scale_inv) or INT4 pack-quantized ((q - zp) * scale)
    checkpoint back to bf16.

    \b
    Example:
      rltool convert dequant --hf models/qwen-fp8 --out models/qwen-bf16
    """
    from rltool.convert import fp8, int4
    from rltool.convert.hf_writer import read_config

    cfg = build_config(DequantConfig, table=TABLE)
    qc = read_config(cfg.hf).get("quantization_config")
    result = (int4 if int4.is_int4_config(qc) else fp8).dequantize_checkpoint(cfg)
    _report(result, as_json=as_json, verb=f"dequantized {result['tensors']} tensors")


@command.command("hf-to-dist")
@stage_options(HfToDistConfig, table=TABLE)
@command_options("config", "json")
def hf_to_dist(as_json, **_):
    """Write a megatron-core torch_dist checkpoint (Megatron-LM layout) from an HF checkpoint.

    Writes OUT/release/ and OUT/latest_checkpointed_iteration.txt = release, the layout
    Megatron-LM and slime `--load` (with --finetune). Run it as one process, or
    under torchrun with tp*pp processes (each rank then reads and writes only its shards).

    \b
    Example:
      rltool convert hf-to-dist --hf models/qwen3 --out ckpt/qwen3_torch_dist --tp 2
      torchrun --nproc-per-node 2 -m rltool convert hf-to-dist --hf models/qwen3 --out ckpt/d --tp 2
    """
    from rltool.convert.torch_dist import hf_to_dist as run

    result = run(build_config(HfToDistConfig, table=TABLE))
    if _is_rank0():
        _report(result, as_json=as_json, verb=f"converted {result['tensors']} tensors")


@command.command("dist-to-hf")
@stage_options(DistToHfConfig, table=TABLE)
@command_options("config", "json")
def dist_to_hf(as_json, **_):
    """Write an HF safetensors checkpoint from a megatron-core torch_dist checkpoint.

    The checkpoint's metadata is unpickled by torch.distributed.checkpoint: only pass paths you
    trust (rltool never reads torch_dist from anywhere else).

    \b
    Example:
      rltool convert dist-to-hf --dist ckpt/qwen3_torch_dist --hf-config models/qwen3 --out hf/
    """
    from rltool.convert.torch_dist import dist_to_hf as run

    result = run(build_config(DistToHfConfig, table=TABLE))
    _report(result, as_json=as_json, verb=f"wrote {result['tensors']} tensors")


def _is_rank0():
    import os

    return os.environ.get("RANK", "0") == "0"


def _report_quantized(result: dict, cfg, *, as_json: bool, suffix: str) -> None:
    """A quantize run's report: with --verify (and not --json) each tensor's relative
    dequantization error and the largest, then the summary line."""
    if cfg.verify and not as_json:
        for name, err in result["relative_error"].items():
            click.echo(f"{err:.3e}  {name}")
        click.echo(f"max relative error {result['max_relative_error']:.3e} over "
                   f"{result['quantized']} quantized tensors")
    _report(result, as_json=as_json, verb=f"quantized {result['quantized']} tensors{suffix}")
