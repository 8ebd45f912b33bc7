"""Prompt data for generating sources: the built-in tasks and their tokenizer, prompt files and
datasets with their column mapping, chat templates, the Hugging Face tokenizer and stop
sequences."""
