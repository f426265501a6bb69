"""Text to token ids exactly as a replica sees them: tokenizer, chat template, incremental encoding."""
