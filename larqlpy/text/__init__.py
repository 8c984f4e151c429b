"""Text: the tokenizer (and its helper process), chat templates and chat messages."""
