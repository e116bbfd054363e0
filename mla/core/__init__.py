"""The vocabulary every layer speaks: model and cache shapes, platforms, provider
capability records, the frozen contexts a support rule reads, reasons, explanations and
typed errors, and the input checks that raise them. Imports nothing else from mla."""
