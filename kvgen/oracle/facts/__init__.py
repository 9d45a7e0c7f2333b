"""The engines' own facts, written from their sources and never from specs: one module per kind
(`layouts`, which merges every source module's table into FACTS; `planes`, `groups`, `models`),
one per source (`host`, `sglang`, `vllm`, `quant`), and their vocabulary (`table`)."""
