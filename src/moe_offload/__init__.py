"""moe-offload: lossless inference of Mixture-of-Experts LLMs with experts offloaded from device memory."""

__version__ = "0.1.0"
