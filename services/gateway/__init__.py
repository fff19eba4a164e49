"""The gateway service: the OpenAI-compatible HTTP front door of radixserve."""
