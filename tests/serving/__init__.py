"""Acceptance tests of the OpenAI-compatible server (`qiao serve`)."""
