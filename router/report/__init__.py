"""``carryover report``: the turn-by-turn report of live traffic, from routers' ``/metrics``."""
