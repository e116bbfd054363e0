"""Prefill strategies, one file per strategy: varlen flash attention and the fp8 persistent
prefill, with cached context processed in chunks merged by LSE."""
