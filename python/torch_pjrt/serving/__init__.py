"""Serving on tpu: the pieces that make inference servers and batch generators run on the device.

`hf_batching`: transformers' continuous batching (`generate_batch`, `transformers serve`) sizes its paged cache
from the device's memory.
"""
