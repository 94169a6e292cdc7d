"""Models: safetensors headers, model-server runtimes in their own environments, the tiny model."""
