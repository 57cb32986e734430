"""ds4trt: DeepSeek V4 Flash inference from ds4 GGUF files, with MTP speculative decoding."""

__version__ = "0.1.0"
