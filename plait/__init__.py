"""plait: GRPO fine-tuning of language models, from one CPU to many nodes."""

__version__ = "0.1.0"
