"""radixserve: an LLM inference server built from small services; this package holds the command line."""
__version__ = "0.1.0"
