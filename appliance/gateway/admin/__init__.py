"""The /admin routes: the status document, engine and model commands, keys and LoRA adapters."""
