"""mm-pipeline: multimodal LLM inference as composable, measurable stages."""
from pipeline.context import Context, Request, Result
from pipeline.errors import UserError
from pipeline.kv import KVCache, Snapshot
from pipeline.loading import LoadedModel, load_model
from pipeline.metrics import Metrics
from pipeline.pipeline import Pipeline, follow
from pipeline.settings import register as _register_settings

_register_settings()  # conf/config.yaml composes over the settings schema (Hydra's ConfigStore)

__all__ = [
    "Context", "Request", "Result", "UserError", "KVCache", "Snapshot",
    "LoadedModel", "load_model", "Metrics", "Pipeline", "follow",
]
