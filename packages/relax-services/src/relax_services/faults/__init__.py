"""Fault handling: the health manager (restarts in place, give-up), the health monitor actor the services beat to,
the watch over actors' processes, and the restart accounting shared by every host."""
