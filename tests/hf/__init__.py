"""Hugging Face integration tests: the experts backend and the block swap, against HF eager on tiny
random models of each family."""
