"""Delta weight sync: encode/apply/verify delta versions (rltool's format and slime's), publish
full-or-delta versions by a cost model, and pull a version into a host-local checkpoint.

Modules: codec (encodings), deltadir (the delta directory layout), diff (encode), apply (rebuild +
verify chains), verify, pull (engine side), publish (trainer side: publish_version, decide then
in-memory, full or delta), cost (the publish cost model), config (DiffConfig, SyncConfig); the
in-memory transports: tensor_sync, shm_read (shared-memory segments), cuda_ipc (CUDA IPC
handles), sync_group (the process group and its rendezvous), sync_limits. Files are read and
written through rltool.io.
Docs: docs/delta.md; formats: docs/formats.md "Delta versions".
"""
