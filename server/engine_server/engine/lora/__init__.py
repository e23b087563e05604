"""LoRA adapters served together with the base model in one batch (docs/adapters.md)."""
