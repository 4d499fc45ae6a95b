"""Rollway's data plane: the OpenAI-compatible gateway, its app factory, settings and CLI."""
