"""Decode strategies, one file per strategy, over the provider contract: the paged
(asm-style) and small-head (Gluon-style) families and their shared machinery."""
