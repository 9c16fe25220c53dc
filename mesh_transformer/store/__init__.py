"""Bytes on disk: local and gs:// storage, TFRecords, safetensors, our checkpoints, the HF and original readers, and
conversion between them."""
