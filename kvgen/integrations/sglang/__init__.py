"""SGLang's pools, read for kvgen: `pools` (kvgen.from_sglang: which spec a device or host pool
binds, and its tree), `host` (the HiCache host pools' readers) and `layouts` (SGLang's own words
for its pool layouts, and the rule that they decide)."""
