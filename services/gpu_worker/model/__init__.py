"""Model definitions and weight loading for the gpu_worker engine."""
