"""Bytes on disk: local and gs:// storage, TFRecords, safetensors, our checkpoints, HF and original readers, conversion."""
