"""`kvgen pd`: `command` (the torch-free command line), `request` (what one run moves: the two
sides' layouts, TP sizes and block sizes) and `run` (the prefill and decode processes over NIXL)."""
