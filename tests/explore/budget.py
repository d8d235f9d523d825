"""How much of the schedule space a test run explores, and where its seed comes from."""

EXPLORE_SEED = "CARRYOVER_EXPLORE_SEED"
#: Schedules drawn at random, run once each.
EXPLORED_SCHEDULES = 1500
#: Schedules whose client leaves at every loop step of one of their turns, in turn.
EXPLORED_SWEEPS = 90
