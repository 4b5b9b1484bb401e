"""raytrain_cpu: train and fine-tune Llama-class causal language models on CPU-only clusters
(Ray Train on gloo, DeepSpeed ZeRO-3, bf16 on AMX)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("raytrain_cpu")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
