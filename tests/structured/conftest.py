"""Shared tiny tokenizer / model / compiler for the structured-output tests."""

import pytest


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from iterserve.model.tokenizer import Tokenizer
    return Tokenizer.from_hf_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from fixtures.tiny_models import load_hf_reference
    return load_hf_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tiny_tok):
    from iterserve.structured.backend import StructuredOutputCompiler
    c = StructuredOutputCompiler(tiny_tok, tiny_tok.vocab_size)
    yield c
    c.close()


@pytest.fixture(scope="module")
def chat_prompt(tiny_tok):
    return tiny_tok.encode_chat([{"role": "user", "content": "Give me JSON."}])
