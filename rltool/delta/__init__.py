"""Delta weight sync: encode/apply/verify delta versions (rltool's format and slime's), publish
full-or-delta versions by a cost model, and pull a version into a host-local checkpoint.

Modules: codec (encodings), deltadir (the delta directory layout), diff (encode), apply (rebuild +
verify chains), verify, pull (engine side), publish (trainer side: publish_version, the cost
model), config (DiffConfig, SyncConfig). Files are read and written through rltool.io.
Docs: docs/delta.md; formats: docs/formats.md "Delta versions".
"""
