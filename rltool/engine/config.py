"""`rltool serve` configuration: one strict pydantic model (flags, or `[serve]` in a TOML file)."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rltool.config import ComputeDtype, StageConfig, cli


INSECURE_HOST = ("--host {host} accepts connections from other machines, and without "
                 "--admin-api-key anyone who reaches the port can replace the weights or stop "
                 "generation; set --admin-api-key KEY, or pass --allow-unauthenticated-admin to "
                 "accept that deliberately")


HOST_NAME = re.compile(r"(?i)[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")  # no scheme, port or path


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


class ServeConfig(StageConfig):
    engine: Literal["builtin", "sglang", "external"] = Field(
        "builtin", description="builtin (this process), sglang (a managed "
                               "sglang.launch_server) or external (attach to --url).")
    model: Path | None = Field(None, description="HF checkpoint directory (config.json, "
                                                 "safetensors, tokenizer).")
    url: str | None = Field(None, description="--engine external: the running engine's URL.")
    sglang_args: list[str] = Field(default_factory=list, description="--sglang-* options passed "
                                   "to sglang.launch_server.", json_schema_extra=cli(option=False))
    health_timeout_s: float = Field(600.0, gt=0, description="--engine sglang/external: how long "
                                                             "to wait for /health.")
    host: str = Field("127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(30000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    ready_file: Path | None = Field(None, description="Written atomically with {url, pid} once "
                                                      "the engine answers requests.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="--engine builtin: cuda (the paged engine), cpu, or auto (cuda when "
                            "available).")
    dtype: ComputeDtype | None = Field(None, description="Weight and compute dtype "
                                                                    "(default bf16 on cuda, fp32 "
                                                                    "on cpu).")
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="KV cache element type: auto (the model dtype) or fp8_e4m3 (one "
                            "float32 scale per token and KV head; about half the bytes).")
    mamba_full_memory_ratio: float | None = Field(
        None, gt=0, description="Hybrid linear-attention models: the recurrent-state pool's share "
        "of the cache budget over the KV pool's (r: states get rB/(1+r), KV B/(1+r)); default "
        "0.9 on cuda, on cpu a state slot per running request.")
    mamba_ssm_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="Hybrid linear-attention models: the recurrent state's dtype "
                          "(default: config.json's mamba_ssm_dtype, else fp32; FP8 KV never "
                          "makes it FP8).")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="cuda: weights + KV pool "
                                                                     "as a fraction of GPU memory.")
    page_size: int = Field(16, ge=1, description="cuda: tokens per KV-cache page.")
    chunked_prefill_size: int | None = Field(None, ge=1, description="Largest prefill chunk of "
                                                                     "one prompt (default: 8192 "
                                                                     "on cuda, "
                                                                     "--max-prefill-tokens on "
                                                                     "cpu).")
    cuda_graph_max_bs: int = Field(256, ge=1, description="cuda: largest decode batch replayed "
                                                          "from a CUDA graph.")
    disable_cuda_graph: bool = Field(False, description="cuda: run decode eagerly.")
    disable_radix_cache: bool = Field(False, description="cuda: do not reuse the KV pages of "
                                                         "cached prompt prefixes.")
    enable_hierarchical_cache: bool = Field(False, description="Move KV pages the prefix cache "
                                            "evicts to a host-memory tier (pinned on cuda) "
                                            "instead of dropping them; a prompt that shares them "
                                            "reloads them.")
    hicache_ratio: float = Field(2.0, gt=0, description="Host tier size as a multiple of the "
                                                        "device KV pool's tokens.")
    hicache_size: float = Field(0, ge=0, description="Host tier size in GB; overrides "
                                                     "--hicache-ratio when above 0.")
    max_running_requests: int | None = Field(
        None, ge=1, description="Largest decode batch (default 256 on cuda, 64 on cpu; --engine "
                                "sglang: SGLang's own).")
    num_continuous_decode_steps: int = Field(
        1, ge=1, description="Decode steps run back to back per scheduler iteration (cuda): "
                             "fewer host round trips; new requests and control operations wait "
                             "for the block to end.")
    max_total_tokens: int | None = Field(None, ge=1, description="KV pool tokens: on cuda a "
                                         "cap on what --mem-fraction-static leaves, on cpu the "
                                         "pool's size.")
    max_queued_requests: int = Field(4096, ge=0, description="Waiting requests beyond the "
                                                             "running ones before 429.")
    max_prefill_tokens: int | None = Field(None, ge=1, description="Prompt tokens prefilled "
                                                                   "per step (default 16384 on "
                                                                   "cuda, 512 on cpu).")
    schedule_policy: Literal["fcfs", "lpm"] = Field(
        "fcfs", description="Order in which waiting requests start: fcfs (arrival order) or lpm "
                            "(longest cached prompt prefix first, for prefix-cache reuse; arrival "
                            "order beyond 128 waiting, as SGLang).")
    prefill_attention: Literal["grouped", "varlen"] = Field(
        "grouped", description="Prefill attention: grouped (one causal SDPA call per group of "
                               "equal-length prompts) or varlen (every chunk of a step in one "
                               "variable-length call per layer: flash attention on cuda in "
                               "bf16, a masked SDPA elsewhere; no GPU run recorded).")
    enable_mixed_chunk: bool = Field(
        False, description="Prefill chunks in the same forward as the running requests' decode "
                           "rows (SGLang's flag): one forward per step instead of two while "
                           "prompts arrive; no GPU run recorded; refused with --deterministic.")
    deterministic: bool = Field(False, description="Seeded, batch-invariant sampling; logprobs "
                                                   "from one unpadded pass (trainer layout).")
    num_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's "
                                                   "default (OMP_NUM_THREADS or the core count).")
    frontend_process: bool | None = Field(
        None, description="--engine builtin: the HTTP front end (parsing, tokenization, "
        "responses, streaming) in a process of its own beside the scheduler's (model, KV cache, "
        "decode loop); default: on with --device cuda, off on cpu (docs/serve.md).")
    weight_version: str = Field("default", description="Initial weight_version string.")
    served_model_name: str | None = Field(None, description="Name in /v1/models and model_info "
                                                            "(default: the model path).")
    api_key: str | None = Field(None, description="Bearer key every route but /health* needs.",
                                 json_schema_extra=cli(envvar="RLTOOL_API_KEY"))
    admin_api_key: str | None = Field(None, description="Bearer key for the routes that change "
                                                        "the engine's state (weights, cache, "
                                                        "pause, abort, memory, debug); required "
                                                        "with a non-loopback --host.",
                                      json_schema_extra=cli(envvar="RLTOOL_ADMIN_API_KEY"))
    allow_unauthenticated_admin: bool = Field(
        False, description="Serve on a non-loopback --host without --admin-api-key (refused "
                           "otherwise: anyone who reaches the port could replace the weights).")
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024,
                                   description="Largest request body (413 beyond).")
    local_checkpoint_dir: Path | None = Field(None, description="Host-local directory "
                                                                "/pull_weights writes into, the "
                                                                "only one it may (or one under "
                                                                "it); without it /pull_weights "
                                                                "answers 400.")
    allowed_weight_root: list[Path] = Field(
        default_factory=list, description="Directories weight paths must lie under (default: "
                                          "the model's parent and --local-checkpoint-dir).")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Builtin engine: host names (or addresses) requests "
        "may name in their Host header besides the bound address and loopback; `*` turns the "
        "check off. Any other Host gets 421 (keeps DNS-rebinding web pages out).")
    allowed_sync_hosts: list[str] = Field(
        default_factory=list, description="Hosts /init_weights_update_group may join a group "
        "at: master_address as written, or an address or CIDR network holding the address it "
        "resolves to (default: any; the request answers 403 otherwise).")
    enable_lora: bool = Field(False, description="Serve LoRA adapters over the base model "
                              "(dense and MoE models in bf16/fp32): requests pick one with "
                              "lora_path, weight syncs of an adapter replace the policy adapter.")
    max_lora_rank: int = Field(16, ge=1, description="--enable-lora: the largest adapter rank "
                               "served (the adapter buffers' size).")
    lora_paths: list[str] = Field(default_factory=list, description="--enable-lora: adapters "
                                  "loaded at start, as NAME=DIR or DIR (named by its path), "
                                  "PEFT adapter directories.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Server log level.")
    enable_debug_endpoints: bool = Field(False, description="Mount POST /debug/hidden_states "
                                         "(align-gate --layerwise); off: 404.")

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if host != "*" and not (HOST_NAME.fullmatch(host) or _is_ip(host.strip("[]"))):
                raise ValueError(f"--allowed-hosts {host!r} is not a host name or an IP address; "
                                 "give the name alone, without scheme or port "
                                 "(--allowed-hosts engine.internal)")
        return hosts

    @model_validator(mode="before")
    @classmethod
    def _device_defaults(cls, data: Any) -> Any:
        """Defaults that depend on the device: filled in before validation, so the fields always
        hold concrete values."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        cuda = data.get("engine", "builtin") == "builtin" and resolve_device(
            data.get("device") or "auto") == "cuda"
        if data.get("dtype") is None:
            data["dtype"] = "bf16" if cuda else "fp32"
        if data.get("max_running_requests") is None and data.get("engine", "builtin") == "builtin":
            data["max_running_requests"] = 256 if cuda else 64
        if data.get("max_prefill_tokens") is None:
            data["max_prefill_tokens"] = 16384 if cuda else 512
        if data.get("chunked_prefill_size") is None:
            data["chunked_prefill_size"] = 8192 if cuda else data["max_prefill_tokens"]
        return data

    @property
    def engine_device(self) -> str:
        return resolve_device(self.device)

    @property
    def uses_frontend_process(self) -> bool:
        """--frontend-process, or its default for the device."""
        if self.frontend_process is None:
            return self.engine_device == "cuda"
        return self.frontend_process

    def weight_roots(self) -> list[Path]:
        assert self.model is not None
        roots = list(self.allowed_weight_root) or [self.model.parent]
        if not self.allowed_weight_root and self.local_checkpoint_dir is not None:
            roots.append(self.local_checkpoint_dir)
        return [Path(os.path.realpath(r)) for r in roots]

    @model_validator(mode="after")
    def _model_exists(self) -> "ServeConfig":
        if self.allowed_hosts and self.engine != "builtin":
            raise ValueError("--allowed-hosts applies to --engine builtin only; SGLang and an "
                             "external engine keep their own Host rules")
        if self.engine == "external":
            if not self.url:
                raise ValueError("--engine external needs --url URL of the running engine")
            return self
        unknown = [a for a in self.sglang_args if a.startswith("-") and not a.startswith("--sglang-")]
        if unknown:
            raise ValueError(f"unknown option {unknown[0]}; SGLang options go as --sglang-<name>")
        if self.sglang_args and self.engine != "sglang":
            raise ValueError("--sglang-* options need --engine sglang")
        if self.model is None:
            raise ValueError(f"--engine {self.engine} needs --model DIR")
        if self.enable_hierarchical_cache and (self.disable_radix_cache or self.engine != "builtin"):
            raise ValueError("--enable-hierarchical-cache needs the builtin engine's prefix cache; "
                             "drop --disable-radix-cache or --enable-hierarchical-cache")
        if not (is_loopback(self.host) or self.admin_api_key or self.allow_unauthenticated_admin):
            raise PydanticCustomError("insecure_host", INSECURE_HOST, {"host": self.host})
        if (self.lora_paths or "max_lora_rank" in self.model_fields_set) and not self.enable_lora:
            raise ValueError("--lora-paths and --max-lora-rank need --enable-lora: add it or "
                             "drop them")
        if self.enable_lora and self.engine != "builtin":
            raise ValueError("--enable-lora is the builtin engine's (SGLang takes "
                             "--sglang-enable-lora and --sglang-lora-paths)")
        self.lora_adapters()
        if self.engine == "builtin" and self.engine_device == "cuda":
            if self.enable_debug_endpoints:
                raise ValueError("--enable-debug-endpoints needs --device cpu")
        if not (self.model / "config.json").is_file():
            raise ValueError(f"--model {self.model} is not a HF checkpoint directory "
                             "(no config.json)")
        return self


    def lora_adapters(self) -> dict[str, Path]:
        """--lora-paths as name -> directory (SGLang's forms: NAME=DIR, or DIR named by itself);
        ValueError naming a malformed entry."""
        out: dict[str, Path] = {}
        for entry in self.lora_paths:
            name, sep, path = entry.partition("=")
            if not sep:
                name = path = entry
            if not (name and path) or name in out:
                raise ValueError(f"--lora-paths {entry!r}: give each adapter once as NAME=DIR "
                                 "or DIR")
            out[name] = Path(path)
        return out


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; cuda without a GPU is refused."""
    if device == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise ValueError("--device cuda: torch sees no CUDA GPU; use --device cpu")
    return "cuda" if available else "cpu"
