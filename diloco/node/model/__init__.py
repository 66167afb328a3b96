"""The model and how it runs on a device.

- ``transformer``: the decoder (presets, QK-norm, z-loss), one readable file.
- ``fragments``: blocks grouped into fragments and their staggered sync schedule.
- ``compute``: precision, micro-batches, compilation (each node's own choice).
- ``device_link``: fragments between an accelerator and pinned host memory, asynchronously.
- ``hf_export``: the outer weights as a ``transformers`` folder with its tokenizer.
"""
