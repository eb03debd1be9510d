"""``roundpipe train``: fine-tune a Hugging Face causal LM on a JSONL file."""
