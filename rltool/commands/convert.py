import click

from rltool.commands.common import (config_option, echo_json, explicit_flags, handle_errors,
                                    json_option, quiet_option, setup_logging)

SECTION = "convert"


@click.group("convert")
def command():
    """Convert checkpoints: HF <-> Megatron torch_dist, and block-FP8 quantization.

    \b
    Example:
      rltool convert fp8 --hf models/tiny --out models/tiny-fp8 --verify
    """


def _resolve(model, ctx, config_file):
    from rltool.config import resolve

    return resolve(model, config_file=config_file, section=SECTION,
                   flags=explicit_flags(ctx, list(model.model_fields)))


def _report(result, *, as_json, verb):
    if as_json:
        echo_json(result)
    else:
        click.echo(f"{verb} -> {result['out']} ({result.get('seconds', 0):.1f} s)", err=True)


@command.command("fp8")
@click.option("--hf", required=True, type=click.Path(file_okay=False), help="Source HF checkpoint.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@click.option("--block", nargs=2, type=int, default=None, help="Block size ROWS COLS [128 128].")
@click.option("--workers", type=int, default=None, help="Worker threads [min(8, CPUs)].")
@click.option("--verify", is_flag=True, default=None,
              help="Print each tensor's relative dequantization error ||deq-w||/||w||.")
@click.option("--max-shard-mb", type=float, default=None, help="Largest output shard in MB [5000].")
@config_option
@json_option
@quiet_option
@click.pass_context
@handle_errors
def fp8(ctx, hf, out, block, workers, verify, max_shard_mb, config_file, as_json, quiet):
    """Quantize an HF checkpoint to block-wise float8_e4m3fn with fp32 weight_scale_inv.

    Norms, embeddings, lm_head, router gates and biases keep their dtype; config.json gains a
    quantization_config that SGLang and vLLM understand.

    \b
    Example:
      rltool convert fp8 --hf models/qwen --out models/qwen-fp8 --block 128 128 --verify
    """
    from rltool.convert.fp8 import Fp8Config, quantize_checkpoint

    setup_logging(quiet=quiet)
    cfg = _resolve(Fp8Config, ctx, config_file)
    result = quantize_checkpoint(cfg)
    if cfg.verify and not as_json:
        for name, err in result["relative_error"].items():
            click.echo(f"{err:.3e}  {name}")
        click.echo(f"max relative error {result['max_relative_error']:.3e} over "
                   f"{result['quantized']} quantized tensors")
    _report(result, as_json=as_json, verb=f"quantized {result['quantized']} tensors")


@command.command("dequant")
@click.option("--hf", required=True, type=click.Path(file_okay=False), help="Block-FP8 checkpoint.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Output dtype [bfloat16].")
@click.option("--workers", type=int, default=None, help="Worker threads [min(8, CPUs)].")
@click.option("--max-shard-mb", type=float, default=None, help="Largest output shard in MB [5000].")
@config_option
@json_option
@quiet_option
@click.pass_context
@handle_errors
def dequant(ctx, hf, out, dtype, workers, max_shard_mb, config_file, as_json, quiet):
    """Dequantize a block-FP8 checkpoint (q * weight_scale_inv) back to bf16.

    \b
    Example:
      rltool convert dequant --hf models/qwen-fp8 --out models/qwen-bf16
    """
    from rltool.convert.fp8 import DequantConfig, dequantize_checkpoint

    setup_logging(quiet=quiet)
    result = dequantize_checkpoint(_resolve(DequantConfig, ctx, config_file))
    _report(result, as_json=as_json, verb=f"dequantized {result['tensors']} tensors")


@command.command("hf-to-dist")
@click.option("--hf", required=True, type=click.Path(file_okay=False), help="Source HF checkpoint.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@click.option("--tp", type=int, default=None, help="Tensor-parallel size [1] (vocab padding).")
@click.option("--pp", type=int, default=None, help="Pipeline-parallel size [1].")
@click.option("--ep", type=int, default=None, help="Expert-parallel size [1].")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              default=None, help="Checkpoint dtype [auto: the HF weights' dtype].")
@config_option
@json_option
@quiet_option
@click.pass_context
@handle_errors
def hf_to_dist(ctx, hf, out, tp, pp, ep, dtype, config_file, as_json, quiet):
    """Write a megatron-core torch_dist checkpoint (Megatron-LM layout) from an HF checkpoint.

    Writes OUT/iter_0000000/ and OUT/latest_checkpointed_iteration.txt. Run it as one process, or
    under torchrun with tp*pp processes (each rank then reads and writes only its shards).

    \b
    Example:
      rltool convert hf-to-dist --hf models/qwen3 --out ckpt/qwen3_torch_dist --tp 2
      torchrun --nproc-per-node 2 -m rltool convert hf-to-dist --hf models/qwen3 --out ckpt/d --tp 2
    """
    from rltool.convert.torch_dist import HfToDistConfig, hf_to_dist as run

    setup_logging(quiet=quiet)
    result = run(_resolve(HfToDistConfig, ctx, config_file))
    if _is_rank0():
        _report(result, as_json=as_json, verb=f"converted {result['tensors']} tensors")


@command.command("dist-to-hf")
@click.option("--dist", "dist", required=True, type=click.Path(file_okay=False),
              help="torch_dist checkpoint (Megatron-LM root or iter_* directory).")
@click.option("--hf-config", required=True, type=click.Path(file_okay=False),
              help="HF directory whose config.json and tokenizer describe the model.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New directory.")
@click.option("--workers", type=int, default=None, help="Writer threads [2].")
@click.option("--max-shard-mb", type=float, default=None, help="Largest output shard in MB [5000].")
@config_option
@json_option
@quiet_option
@click.pass_context
@handle_errors
def dist_to_hf(ctx, dist, hf_config, out, workers, max_shard_mb, config_file, as_json, quiet):
    """Write an HF safetensors checkpoint from a megatron-core torch_dist checkpoint.

    The checkpoint's metadata is unpickled by torch.distributed.checkpoint: only pass paths you
    trust (rltool never reads torch_dist from anywhere else).

    \b
    Example:
      rltool convert dist-to-hf --dist ckpt/qwen3_torch_dist --hf-config models/qwen3 --out hf/
    """
    from rltool.convert.torch_dist import DistToHfConfig, dist_to_hf as run

    setup_logging(quiet=quiet)
    result = run(_resolve(DistToHfConfig, ctx, config_file))
    _report(result, as_json=as_json, verb=f"wrote {result['tensors']} tensors")


def _is_rank0():
    import os

    return os.environ.get("RANK", "0") == "0"
