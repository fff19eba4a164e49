"""The tokenizer service: chat templates, tokenizing, prompt block hashes, incremental detokenizing, stop strings."""
