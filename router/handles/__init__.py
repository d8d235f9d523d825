"""The handles the router holds: the fate table (how far a handle got and what happened, to
what becomes of it) and the ledger that carries each fate out, once."""
