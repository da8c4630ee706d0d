"""The engine's HTTP contract, shared by the server (rltool.engine.routes) and its clients
(rltool.rollout.client.EngineClient, rltool.align.layerwise): route paths, headers and the typed
request and response bodies.

Names and shapes are SGLang's (docs/engine-api.md), so the same client drives the builtin engine,
SGLang and an smg gateway. This module imports only pydantic and the sync limits (which import
nothing): a client importing it loads neither the server (fastapi) nor the model code (torch).

Request bodies ignore unknown top-level keys (gateways add their own, e.g. smg's `model`,
`log_metrics`); `sampling_params` keys are strict (rltool.engine.sampling).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rltool.delta.sync_limits import (CUDA_IPC_HANDLE_BYTES, CUDA_IPC_REF_COUNTER_SLOTS,
                                     DEFAULT_SYNC_TIMEOUT_S, MAX_CUDA_IPC_HANDLE_BYTES,
                                     TORCH_REF_COUNTER_NAME)

# ----- route paths ---------------------------------------------------------------------------

GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
READY = "/ready"
LOADS = "/v1/loads"
MODEL_INFO = "/get_model_info"
MODEL_INFO_ALIAS = "/model_info"
SERVER_INFO = "/get_server_info"
SERVER_INFO_ALIAS = "/server_info"
WEIGHT_VERSION = "/get_weight_version"
WEIGHT_VERSION_ALIAS = "/weight_version"

FLUSH_CACHE = "/flush_cache"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
ABORT_REQUEST = "/abort_request"
RELEASE_MEMORY = "/release_memory_occupation"
RESUME_MEMORY = "/resume_memory_occupation"

UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
PULL_WEIGHTS = "/pull_weights"
UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
LOAD_LORA_ADAPTER = "/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"

OPENAI_MODELS = "/v1/models"
OPENAI_COMPLETIONS = "/v1/completions"
OPENAI_CHAT_COMPLETIONS = "/v1/chat/completions"

DEBUG_HIDDEN_STATES = "/debug/hidden_states"

# Routes that answer without any key (liveness probes and load balancers poll them).
OPEN_PATHS = frozenset({HEALTH, HEALTH_GENERATE, READY})

# ----- headers -------------------------------------------------------------------------------

AUTHORIZATION = "Authorization"
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # smg's consistent-hash routing key


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header that carries `key` (none when there is no key)."""
    return {AUTHORIZATION: f"Bearer {key}"} if key else {}


# ----- request bodies ------------------------------------------------------------------------


class GenerateInput(BaseModel):
    """POST /generate body. A batch (list of prompts) and/or `n > 1` expand prompt-major into one
    request per sample, whose response goes at the same position of the returned list."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    # MoE models: meta_info["routed_experts"] of a finished request, base64 of little-endian
    # int32 [prompt + completion tokens - 1, num_hidden_layers, top_k] (-1 in dense layers).
    return_routed_experts: bool | list[bool] = False
    # --enable-lora: the loaded adapter to run (per prompt as a list); None: the policy adapter
    lora_path: str | list[str | None] | None = None

    @field_validator("return_logprob", "logprob_start_len", "top_logprobs_num",
                     "return_routed_experts", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        defaults = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
                    "return_routed_experts": False}
        return defaults[info.field_name] if value is None else value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def body(self) -> dict[str, Any]:
        """The JSON a client sends: fields left at their default are omitted (SGLang's defaults
        are the same), so the body stays valid for every engine that speaks the API."""
        return self.model_dump(mode="json", exclude_defaults=True)


class PauseInput(_Body):
    mode: str = Field("abort", description="abort, retract or in_place")


class ContinueInput(_Body):
    torch_empty_cache: bool = True


class AbortInput(_Body):
    rid: str = ""
    abort_all: bool = False


class MemoryInput(_Body):
    tags: list[str] | None = None


class UpdateWeightsFromDiskInput(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class LoadLoraAdapterInput(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str


class UnloadLoraAdapterInput(_Body):
    lora_name: str = Field(min_length=1)


class LoraAdapterResult(BaseModel):
    """SGLang's /load_lora_adapter and /unload_lora_adapter answer: the adapters loaded after
    the call, name -> path."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = {}


class UpdateWeightVersionInput(_Body):
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True


class PullWeightsInput(_Body):
    """slime's /pull_weights body: bring `local_checkpoint_dir` to `target_version` of the
    versions published in `source_dir` (files only; the caller then loads them)."""

    local_checkpoint_dir: str
    source_dir: str
    target_version: int


# load_formats of /update_weights_from_tensor whose serialized_named_tensors are rltool's JSON
# tensor messages (`TensorMessage`): a shared-memory segment (CPU engines) or a CUDA IPC handle of
# a device buffer (CUDA engines, sender on the same GPU). SGLang's own formats carry pickled
# tensors, which rltool never loads.
SHM_FORMAT = "rltool_shm"
CUDA_IPC_FORMAT = "rltool_cuda_ipc"
TENSOR_FORMATS = (SHM_FORMAT, CUDA_IPC_FORMAT)


class TensorEntry(BaseModel):
    """One tensor of a bucket: C-contiguous at byte `offset` of the segment."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    dtype: str = Field(description="float32, bfloat16, float16 or float8_e4m3fn")
    shape: list[int]
    offset: int = Field(ge=0)


def _b64_field(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as e:
        raise ValueError(f"{what} is not base64: {e}") from None


class CudaIpcHandle(BaseModel):
    """The fields of a CUDA IPC export of one device buffer (torch's `_share_cuda_`), bytes in
    base64: what torch.multiprocessing pickles, written out so that no pickle is loaded. The
    fields torch trusts are checked here: the reference-counter name and slot, the event
    handle's size; the storage range is checked against the real allocation once opened
    (rltool.delta.cuda_ipc)."""

    model_config = ConfigDict(extra="forbid")
    device_uuid: str = Field(min_length=1, max_length=100,
                             description="the GPU's UUID (device indices differ between "
                                         "processes)")
    handle: str = Field(min_length=1)
    storage_bytes: int = Field(ge=0, lt=1 << 62)
    storage_offset: int = Field(ge=0, lt=1 << 62)
    ref_counter_handle: str = Field(description="base64 of torch's /torch_<pid>_<n>_<n> name")
    ref_counter_offset: int = Field(ge=0, lt=CUDA_IPC_REF_COUNTER_SLOTS)
    event_handle: str | None = None
    event_sync_required: bool = False

    @field_validator("handle")
    @classmethod
    def _handle_size(cls, value: str) -> str:
        if len(_b64_field(value, "handle")) > MAX_CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"handle exceeds {MAX_CUDA_IPC_HANDLE_BYTES} bytes; send the "
                             "fields of one _share_cuda_ export")
        return value

    @field_validator("ref_counter_handle")
    @classmethod
    def _torch_ref_counter(cls, value: str) -> str:
        raw = _b64_field(value, "ref_counter_handle")
        if not TORCH_REF_COUNTER_NAME.fullmatch(raw.decode("ascii", "replace")):
            raise ValueError("ref_counter_handle must name torch's reference-counter file "
                             "(/torch_<pid>_<n>_<n>, as _share_cuda_ returns it)")
        return value

    @field_validator("event_handle")
    @classmethod
    def _event_size(cls, value: str | None) -> str | None:
        if value is not None and len(_b64_field(value, "event_handle")) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"event_handle must hold {CUDA_IPC_HANDLE_BYTES} bytes (a "
                             "cudaIpcEventHandle_t)")
        return value

    @model_validator(mode="after")
    def _event_when_required(self) -> "CudaIpcHandle":
        if self.event_sync_required and self.event_handle is None:
            raise ValueError("event_sync_required needs event_handle")
        return self


class TensorMessage(BaseModel):
    """One bucket of named tensors, handed over without copying them into the request: the
    tensors lie in `segment`, a shared-memory file (`/dev/shm/<segment>`, named rltool-*), or
    (transport cuda_ipc) in the device buffer of `cuda_ipc`; either way the sender owns it and
    keeps it unchanged until the answer arrives."""

    model_config = ConfigDict(extra="forbid")
    transport: Literal["shm", "cuda_ipc"] = "shm"
    segment: str | None = Field(None, pattern=r"^rltool-[A-Za-z0-9_.-]{1,100}$")
    cuda_ipc: CudaIpcHandle | None = None
    nbytes: int = Field(ge=0)
    tensors: list[TensorEntry]
    weight_block_size: list[int] | None = Field(
        None, min_length=2, max_length=2, description="Block-FP8 weights: [bn, bk] of the "
        "float8_e4m3fn weights, each followed by its float32 `<name>_scale_inv`.")

    @model_validator(mode="after")
    def _one_source(self) -> "TensorMessage":
        if self.transport == "shm" and (self.segment is None or self.cuda_ipc is not None):
            raise ValueError("transport shm needs segment (and no cuda_ipc)")
        if self.transport == "cuda_ipc" and (self.cuda_ipc is None or self.segment is not None):
            raise ValueError("transport cuda_ipc needs cuda_ipc (and no segment)")
        return self


LORA_CONFIG = ("rltool's: with LoRA tensors, the adapter's PEFT LoraConfig fields (r, lora_alpha, "
               "target_modules, ...); the policy adapter's scale becomes lora_alpha / r")


class UpdateWeightsFromTensorInput(_Body):
    """SGLang's body: one serialized message per tensor-parallel rank (the builtin engine has
    one); with load_format "rltool_shm" each is a `TensorMessage` as a JSON string."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    lora_config: dict[str, Any] | None = Field(None, description=LORA_CONFIG)


class InitWeightsUpdateGroupInput(_Body):
    """SGLang's body: the engine joins a torch process group as rank `rank_offset` (the trainer
    is rank 0) at `master_address:master_port`. `timeout_s` (rltool's, sent only when set)
    bounds the join: past it the engine answers 504."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = Field(DEFAULT_SYNC_TIMEOUT_S, gt=0, le=3600)


class UpdateWeightsFromDistributedInput(_Body):
    """SGLang's body: rank 0 broadcasts each named tensor, in this order, over `group_name`."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    lora_config: dict[str, Any] | None = Field(None, description=LORA_CONFIG)


class HiddenStatesInput(_Body):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] = Field(min_length=2, description="Token ids, at least two.")


# ----- response bodies -----------------------------------------------------------------------


class UpdateWeightsResult(BaseModel):
    """POST /update_weights_from_disk answer (200 on success, 400 with success=false)."""

    model_config = ConfigDict(extra="allow")
    success: bool
    message: str
    num_paused_requests: int = 0


class PullWeightsResult(BaseModel):
    """POST /pull_weights answer: SGLang's {success, message} plus what was synced."""

    model_config = ConfigDict(extra="allow")
    success: bool
    message: str
    pull: dict[str, Any] | None = None


class UpdateWeightVersionResult(BaseModel):
    model_config = ConfigDict(extra="allow")
    success: bool
    message: str
    new_version: str


class ControlResult(BaseModel):
    """POST /pause_generation and /continue_generation answer."""

    model_config = ConfigDict(extra="allow")
    message: str
    status: str = "ok"


class WeightVersionInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    weight_version: str | None


def url_of(host: str, port: int) -> str:
    """The base URL of an engine bound to `host` (IPv6 literals in brackets) and `port`."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
