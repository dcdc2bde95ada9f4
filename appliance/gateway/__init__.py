"""The authenticated OpenAI-compatible gateway, served from the supervisor's process."""
