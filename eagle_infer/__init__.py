"""eagle_infer: target runtime, draft heads and speculative decoding (EAGLE-2 / EAGLE-3)."""
