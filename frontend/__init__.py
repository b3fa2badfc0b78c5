"""The front door: one OpenAI-compatible HTTP endpoint over every decode group of a deployment."""
