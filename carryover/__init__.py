"""The ``carryover`` command: one entry point for the router and its tools."""
