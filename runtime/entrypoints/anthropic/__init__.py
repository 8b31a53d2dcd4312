"""Anthropic's Messages API (``POST /v1/messages``) over the OpenAI chat serving path."""
