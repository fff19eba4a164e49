"""scheduler: admission, queueing and routing of tokenized requests to workers; worker registry and liveness."""
