"""The model families, one module each; importing this package registers them (model/family.py)."""
from mesh_transformer.model.families import gptj, gptneox  # noqa: F401
