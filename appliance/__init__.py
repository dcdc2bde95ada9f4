"""llm-appliance: vLLM engines under a thermal-aware supervisor, behind an authenticated gateway."""

__version__ = "0.1.0"
