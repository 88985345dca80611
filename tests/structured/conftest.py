"""Fixtures for the structured tests: the shared ones in fixtures/structured_fixtures.py."""

from fixtures.structured_fixtures import chat_prompt, compiler, tiny_model, tiny_tok  # noqa: F401
