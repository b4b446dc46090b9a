"""Anthropic's Messages API, served as a translation onto the OpenAI chat path (serving_messages.py)."""
