"""Everything that touches llama-cpp-python: the batched decoder and the critic backend on it."""
