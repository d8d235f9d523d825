"""The fleet: the instances behind the router, their health and load, the choice of P and D, and pressure relief."""
