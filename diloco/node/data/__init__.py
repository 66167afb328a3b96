"""Data: what a node trains on, and how a run names it.

- ``corpus``: byte-level text and token files, the held-out split, the tokenizer identity a
  run records and the checks that refuse another tokenizer's data.
- ``prepare``: ``diloco-node prepare-data`` (text, JSONL, Parquet into token files).
- ``tokenizer``: raw bytes or a ``tokenizer.json``.
- ``manifest``: what made a prepared folder's tokens (files, tokenizer, fingerprint).
"""
