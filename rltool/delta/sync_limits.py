"""The limits of in-memory weight sync, shared by the engine's request models (rltool.engine.api)
and the transports that enforce them (rltool.delta.cuda_ipc, rltool.delta.sync_group). It
imports nothing of rltool or torch, so the HTTP client loads nothing more for it."""

import re

# torch's names for the CUDA IPC reference-counter file (a POSIX shared-memory object,
# at::NewProcessWideShmHandle: "/torch_<pid>_<random uint32>_<counter>"), its number of int64
# slots (torch::CUDA_IPC_REF_COUNTER_FILE_SIZE) and the size of a cudaIpc*Handle_t. On release
# torch opens that object read-write and decrements the slot at `ref_counter_offset`, so both
# are checked before a handle is opened.
TORCH_REF_COUNTER_NAME = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,10}_[0-9]{1,20}")
CUDA_IPC_REF_COUNTER_SLOTS = 10000
CUDA_IPC_HANDLE_BYTES = 64
MAX_CUDA_IPC_HANDLE_BYTES = 1 << 20  # an expandable segment lists one handle per page

# The largest weight-sync group an engine joins (each rank costs the engine memory and
# connections), and how long joining may take unless the request says otherwise.
MAX_SYNC_WORLD_SIZE = 1024
DEFAULT_SYNC_TIMEOUT_S = 120.0
