"""The tiny QA set beside this file, as a datasets.DatasetDict (no hub, no network)."""

from pathlib import Path

import datasets


def load(**kwargs):
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(
        str(Path(__file__).with_name("tiny_qa.jsonl")))})
