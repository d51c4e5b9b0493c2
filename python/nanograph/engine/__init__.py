"""The engine: sequences, KV block accounting, scheduling, batch metadata and the step loop."""
