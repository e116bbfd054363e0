"""The ``gluon`` kernel provider: Hopper-native MLA decode written in Triton's Gluon dialect."""
