"""Where arrays live and how steps are partitioned: the mesh builder and the Layout (shard_map or GSPMD)."""
